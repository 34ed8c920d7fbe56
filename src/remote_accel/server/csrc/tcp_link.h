// A TCP session's socket as a Link of the C++ receive loop (fast_loop.h).
//
// The loop reads through the transport's own read-ahead buffer (dataplane/tcp.py): the
// bytes it reads and leaves there are the bytes Python's recv() reads next, so a message
// the loop does not serve goes back to Python untouched. Python hands its buffer's state
// over before each run (set_read_ahead) and takes it back after (read_ahead): only the
// session's thread reads the socket, and it runs either Python or the loop.
//
// Waiting as tcp.py's receiver does: after traffic it polls the socket without blocking
// (yielding the core between polls) for `poll_ns`, then blocks in ppoll; a yield that
// outlasts the whole window (others' work took the core) pauses polling, 1 ms doubling
// to 1 s, as tcp_poll.py's PollWindow does and for the same reason. Anything odd (a
// prologue that does not check out, a message longer than the buffer, a message not all
// there yet) is left to Python, which reads, waits and raises as before.
//
// Prologues are checked and encoded by the shim's own C (dpdk_shim/wire/prologue.c, compiled
// into this module too: it needs no DPDK).
//
// The socket is a dup() of the transport's: Python's close() (shutdown, then close) ends
// a wait here through the shutdown, and the number this link uses is never reused under it.
#pragma once

#include "fast_loop.h"

#include <sys/uio.h>

#include <atomic>
#include <mutex>
#include <cstddef>
#include <cstdint>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace remote_accel::server {

// A prologue at the start of `len` bytes of a stream, checked by the shim's C: its fields,
// and its message's whole length from its header (msg_len; 0 for a header wire.py
// refuses); status 0 when the bytes hold a whole valid prologue.
void prologue_check(const shim_wire& w, const uint8_t* p, uint64_t len, shim_msg_info* out);

class TcpLink : public Link {
 public:
  // fd: the transport's socket (dup'ed here); buffer/capacity: its read-ahead buffer, which
  // must outlive this link; stall_ns: how long a reply may wait for the socket to drain.
  TcpLink(int fd, uintptr_t buffer, size_t capacity, const shim_wire& wire, int64_t poll_ns, int64_t stall_ns);
  ~TcpLink() override;
  TcpLink(const TcpLink&) = delete;
  TcpLink& operator=(const TcpLink&) = delete;

  int64_t next(int64_t timeout_ns, const char** bytes, shim_msg_info* info) override;
  void consumed() override;
  int send(uint8_t type, uint32_t req_id, const std::string& meta, const void* payload, size_t nbytes) override;

  // Closes this link's socket (the session's end; the destructor's otherwise).
  virtual void close();
  void set_read_ahead(size_t head, size_t tail);
  std::pair<size_t, size_t> read_ahead() const { return {head_, tail_}; }
  // (rx messages, rx bytes, tx messages, tx bytes) served and sent here since the last
  // call: the transport's counters (its stats(), the server's metrics) add them.
  std::tuple<int64_t, int64_t, int64_t, int64_t> take_counts();

 protected:
  // The byte stream under the link (TlsLink: the stream TLS decrypts). raw_read: up to `cap`
  // bytes without waiting; >0 bytes, 0 the peer's end, -EAGAIN nothing there, other -errno.
  virtual int64_t raw_read(char* dst, size_t cap);
  // raw_write: the whole of iov[0..n) by `deadline_ns`; 0, -ETIMEDOUT (the peer stopped
  // reading), other -errno. Called with fd_mu_ held; may unlock it while it waits.
  virtual int raw_write(iovec* iov, int n, int64_t deadline_ns, std::unique_lock<std::mutex>& fd_lock);
  // the events a wait for more bytes polls for (TlsLink: also POLLOUT while TLS must write)
  virtual short read_events() const;

 private:
  // Reads what the socket holds into the buffer after tail_ (raw_read).
  int64_t read_more();
  // Waits until the socket is readable or `deadline_ns` (steady clock) passes.
  int wait_readable(int64_t deadline_ns);

 protected:  // TlsLink's too
  int fd_;
  char* buf_;
  size_t cap_;
  shim_wire wire_;
  static constexpr int64_t kContendedPauseNs = 1'000'000, kContendedPauseMaxNs = 1'000'000'000;
  int64_t poll_ns_, stall_ns_;
  int64_t paused_until_ns_ = 0, pause_ns_ = kContendedPauseNs;  // only the loop's thread waits
  size_t head_ = 0, tail_ = 0;
  size_t pending_ = 0;  // bytes of the message next() returned
  std::atomic<int64_t> last_traffic_ns_{0};  // a read or a send (the heartbeat's too)
  std::vector<uint8_t> send_buf_;  // a reply's prologue; sends are serialised by the loop
  std::mutex fd_mu_;  // fd_ against close; TlsLink: every call into the SSL object
  std::atomic<int64_t> rx_messages_{0}, rx_bytes_{0}, tx_messages_{0}, tx_bytes_{0};  // a send (the heartbeat's thread) against close: the number is not reused under it
};

} // namespace remote_accel::server
