// A session's receive loop in C++, for DPDK and TCP connections (issue #20: a sync point's
// server time was Python on every message: the transport's recv wrapper, the dispatch, the
// executor's resume call, the reply's send wrapper, about 7 us each).
//
// The loop takes messages off the connection through a Link (the shim's own recv for
// DPDK, tcp_link.h for a TCP socket) and serves the common ones without the GIL: a Batch
// the executor scans whole and runs to its end (on a CPU server also one that carries
// small uploads whole in the link's buffer: its WRITEs copy their bytes in, in order with
// the ops around them), a small READ of a CPU server (its bytes
// sent straight out of the storage), a SYNC of a CPU server without a pending error.
// Everything else goes back to Python (session.py) as it came: a message whose head lies
// in the transport's own buffer (Python's finish_recv reads the rest), or a Batch stopped
// at an item Python must run or that failed (Python resumes it). Semantics are Python's: same replies, same
// order, same errors; only who runs them changes.
//
// Sends: the loop's replies and the session's heartbeat (send_pong) share a mutex; the
// session's Python sends happen in the loop's own thread, never at the same time.
#pragma once

#include "native.h"

extern "C" {
#include "shim.h"
}

#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

namespace remote_accel::server {

// A request's meta that is a tuple of `n` ints and nothing else (READ: 3, SYNC: 0), read
// into out[0..n); false for anything else, which Python's decoder rejects in its words.
bool int_fields(const char* meta, size_t len, int64_t* out, uint32_t n);

// Where bytes [offset, offset + nbytes) of a CPU server's storage `sid` lie (*bytes),
// pinned until unpin(); false for anything else (a device storage, no such storage, a bad
// range, a swap-in that failed): Python's path then says what is wrong.
bool small_read(Executor& executor, int64_t sid, int64_t offset, int64_t nbytes, const char** bytes);

// Where the loop's messages come from and its replies go: one connection.
class Link {
 public:
  virtual ~Link() = default;
  // The next message: >= 0, its first bytes at *bytes (all of it when info->msg_len equals
  // the return value) and what its prologue says in *info (status 0: checked valid); or
  // -errno (-ETIMEDOUT: nothing came within timeout_ns, 0: only look). A message the loop
  // does not serve is left to Python's finish_recv.
  virtual int64_t next(int64_t timeout_ns, const char** bytes, shim_msg_info* info) = 0;
  // The message next() gave was served here: the link may drop its bytes.
  virtual void consumed() {}
  // One message (at most one payload); 0 or -errno. Callers serialise sends.
  virtual int send(uint8_t type, uint32_t req_id, const std::string& meta, const void* payload, size_t nbytes) = 0;
};

// A DPDK connection: the shim's functions through the addresses cffi gives.
class DpdkLink : public Link {
 public:
  struct Addresses {  // the transport's C objects and the shim's functions (cffi addresses)
    uintptr_t conn, wire, head, head_cap, info, recv_msg, send_msg;
  };
  explicit DpdkLink(const Addresses& a);
  int64_t next(int64_t timeout_ns, const char** bytes, shim_msg_info* info) override;
  int send(uint8_t type, uint32_t req_id, const std::string& meta, const void* payload, size_t nbytes) override;

 private:
  using RecvMsg = int64_t (*)(shim_conn*, const shim_wire*, void*, uint64_t, int64_t, shim_msg_info*);
  using SendMsg = int (*)(shim_conn*, const shim_wire*, uint8_t, uint16_t, uint32_t, const char*, uint32_t,
                          const shim_iov*, int);
  shim_conn* conn_;
  const shim_wire* wire_;
  char* head_;
  uint64_t head_cap_;
  shim_msg_info* info_;  // the transport's own: its finish_recv reads it
  RecvMsg recv_msg_;
  SendMsg send_msg_;
};

class FastLoop {
 public:
  struct Types {  // the wire's message type numbers (dataplane/wire.py)
    int batch, read, sync, data, sync_ok, pong;
  };
  // Why run() returned.
  enum Code : int { kYield = 0, kMessage = 1, kFailed = 2, kStopped = 3 };
  struct Result {
    Code code = kYield;
    int64_t value = 0;  // kMessage: bytes of the message the link holds; kFailed: -errno
    Executor::Stop stop;  // kStopped
  };

  // `link` outlives the loop (the Python object holding both keeps it alive).
  FastLoop(Executor& executor, Link& link, const Types& t, bool cpu_device, size_t small_read,
           std::string pong_meta);

  // Serves messages until one needs Python, the connection fails, `timeout_ns` pass
  // without a message (kFailed, -ETIMEDOUT), or it has served some and none is waiting
  // (kYield: Python looks at its counters and calls again). Call without the GIL.
  // python_ops: ops Python ran (a SyncOk counts them too); pending: Python holds an
  // error for the next sync point (it answers READ and SYNC then).
  Result run(int64_t timeout_ns, int64_t python_ops, bool pending);

  // The heartbeat's PONG (request id 0), serialised with the loop's replies. No GIL needed.
  int send_pong();

  bool busy() const { return busy_.load(std::memory_order_relaxed); }
  const std::string& batch_meta() const { return executor_.batch_meta(); }
  // Nanoseconds each Batch the loop ran took, since the last call (the session's metrics).
  std::vector<int64_t> take_batch_ns();
  // Messages served here, by kind: (batches, reads, syncs).
  std::tuple<int64_t, int64_t, int64_t> served() const { return {batches_, reads_, syncs_}; }

 private:
  // Each returns true when it served the message, false when Python must (untouched).
  bool serve_batch(const char* meta, size_t len, const char* message, Result& out);
  bool serve_read(const char* meta, size_t len, uint32_t req_id, bool pending, int& rc);
  bool serve_sync(const char* meta, size_t len, uint32_t req_id, int64_t python_ops, bool pending, int& rc);
  int send(int type, uint32_t req_id, const std::string& meta, const void* payload, size_t nbytes);

  Executor& executor_;
  Link& link_;
  shim_msg_info info_{};
  Types types_;
  bool cpu_;
  size_t small_read_;
  std::string pong_meta_;
  std::string reply_meta_;  // scratch for a reply's encoded meta
  std::vector<uint64_t> lengths_;  // scratch: a Batch's payload lengths

  std::mutex send_mu_;
  std::atomic<bool> busy_{false};  // read by the heartbeat's thread
  std::vector<int64_t> batch_ns_;  // written by run(), taken after it: the session's thread only
  int64_t batches_ = 0, reads_ = 0, syncs_ = 0;
};

} // namespace remote_accel::server
