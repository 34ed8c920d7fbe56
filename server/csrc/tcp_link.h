// A TCP session's socket as a Link of the C++ receive loop (fast_loop.h).
//
// The loop reads through the transport's own read-ahead buffer (dataplane/tcp.py): the
// bytes it reads and leaves there are the bytes Python's recv() reads next, so a message
// the loop does not serve goes back to Python untouched. Python hands its buffer's state
// over before each run (set_read_ahead) and takes it back after (read_ahead): only the
// session's thread reads the socket, and it runs either Python or the loop.
//
// Waiting as tcp.py's receiver does: after traffic it polls the socket without blocking
// (yielding the core between polls) for `poll_ns`, then blocks in ppoll. Anything odd (a
// prologue that does not check out, a message longer than the buffer, a message not all
// there yet) is left to Python, which reads, waits and raises as before.
//
// The socket is a dup() of the transport's: Python's close() (shutdown, then close) ends
// a wait here through the shutdown, and the number this link uses is never reused under it.
#pragma once

#include "fast_loop.h"

#include <atomic>
#include <mutex>
#include <cstddef>
#include <cstdint>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace remote_accel::server {

// The prologue of dataplane/wire.py, in C++ (as dpdk_shim/wire.c: the server module links
// nothing of the shim). check: status 0 when `bytes` hold a whole valid prologue of a
// message of `msg_len` bytes (fields filled in either way where readable); encode: header,
// length table (one payload at most) and meta, CRC filled in; returns its length.
struct WireParams {
  uint8_t magic0, magic1, version;
  uint64_t max_meta, max_payloads, max_payload_total;
};
constexpr size_t kWireHeader = 28;
void wire_check(const WireParams& w, const uint8_t* bytes, uint64_t len, shim_msg_info* out);
size_t wire_encode(const WireParams& w, uint8_t* out, uint8_t type, uint32_t req_id, const std::string& meta,
                   const uint64_t* payload_len);
uint32_t crc32c(uint32_t crc, const uint8_t* data, size_t n);

class TcpLink : public Link {
 public:
  // fd: the transport's socket (dup'ed here); buffer/capacity: its read-ahead buffer, which
  // must outlive this link; stall_ns: how long a reply may wait for the socket to drain.
  TcpLink(int fd, uintptr_t buffer, size_t capacity, const WireParams& wire, int64_t poll_ns, int64_t stall_ns);
  ~TcpLink() override;
  TcpLink(const TcpLink&) = delete;
  TcpLink& operator=(const TcpLink&) = delete;

  int64_t next(int64_t timeout_ns, const char** bytes, shim_msg_info* info) override;
  void consumed() override;
  int send(uint8_t type, uint32_t req_id, const std::string& meta, const void* payload, size_t nbytes) override;

  // Closes this link's socket (the session's end; the destructor's otherwise).
  void close();
  void set_read_ahead(size_t head, size_t tail);
  std::pair<size_t, size_t> read_ahead() const { return {head_, tail_}; }
  // (rx messages, rx bytes, tx messages, tx bytes) served and sent here since the last
  // call: the transport's counters (its stats(), the server's metrics) add them.
  std::tuple<int64_t, int64_t, int64_t, int64_t> take_counts();

 private:
  // Reads what the socket holds into the buffer after tail_; >0 bytes, 0 the peer's end,
  // -EAGAIN nothing there, other -errno.
  int64_t read_more();
  // Waits until the socket is readable or `deadline_ns` (steady clock) passes.
  int wait_readable(int64_t deadline_ns);

  int fd_;
  char* buf_;
  size_t cap_;
  WireParams wire_;
  int64_t poll_ns_, stall_ns_;
  size_t head_ = 0, tail_ = 0;
  size_t pending_ = 0;  // bytes of the message next() returned
  std::atomic<int64_t> last_traffic_ns_{0};  // a read or a send (the heartbeat's too)
  std::vector<uint8_t> send_buf_;  // a reply's prologue; sends are serialised by the loop
  std::mutex fd_mu_;
  std::atomic<int64_t> rx_messages_{0}, rx_bytes_{0}, tx_messages_{0}, tx_bytes_{0};  // a send (the heartbeat's thread) against close: the number is not reused under it
};

} // namespace remote_accel::server
