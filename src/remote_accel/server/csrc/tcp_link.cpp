// A TCP session's socket for the C++ receive loop: tcp_link.h says how it shares the
// transport's read-ahead buffer with Python.
#include "tcp_link.h"

#include <poll.h>
#include <sched.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstring>
#include <stdexcept>

namespace remote_accel::server {

void prologue_check(const shim_wire& w, const uint8_t* p, uint64_t len, shim_msg_info* out) {
  shim_wire_check(&w, p, len, 0, out);  // the header's fields (a message length of 0 never matches)
  if (out->prologue_len == 0) {  // bad magic, version or limits
    out->msg_len = 0;
    return;
  }
  const uint64_t msg_len = out->prologue_len + out->payload_total;
  if (out->prologue_len <= len) {
    shim_wire_check(&w, p, len, msg_len, out);  // lengths and CRC
  }
  out->msg_len = msg_len;
}

TcpLink::TcpLink(int fd, uintptr_t buffer, size_t capacity, const shim_wire& wire, int64_t poll_ns,
                 int64_t stall_ns)
    : fd_(::dup(fd)),
      buf_(reinterpret_cast<char*>(buffer)),
      cap_(capacity),
      wire_(wire),
      poll_ns_(poll_ns),
      stall_ns_(stall_ns) {
  if (fd_ < 0) throw std::runtime_error(std::string("dup of the session's socket failed: ") + std::strerror(errno));
}

TcpLink::~TcpLink() { close(); }

void TcpLink::close() {
  std::lock_guard<std::mutex> lock(fd_mu_);
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;  // reads and sends fail with EBADF from now on
}

void TcpLink::set_read_ahead(size_t head, size_t tail) {
  if (head > tail || tail > cap_) throw std::out_of_range("read-ahead window outside the buffer");
  head_ = head;
  tail_ = tail;
  pending_ = 0;
}

int64_t TcpLink::read_more() {
  if (head_ == tail_) {
    head_ = tail_ = 0;
  } else if (head_ > 0) {  // a message's start: move it to the front, read its rest behind it
    std::memmove(buf_, buf_ + head_, tail_ - head_);
    tail_ -= head_;
    head_ = 0;
  }
  const int64_t n = raw_read(buf_ + tail_, cap_ - tail_);
  if (n > 0) {
    tail_ += static_cast<size_t>(n);
    last_traffic_ns_.store(now_ns(), std::memory_order_relaxed);
  }
  return n;
}

int64_t TcpLink::raw_read(char* dst, size_t cap) {
  for (;;) {
    const ssize_t n = ::recv(fd_, dst, cap, MSG_DONTWAIT);
    if (n >= 0) return n;
    if (errno == EINTR) continue;
    return (errno == EWOULDBLOCK) ? -EAGAIN : -errno;
  }
}

short TcpLink::read_events() const { return POLLIN; }

int TcpLink::wait_readable(int64_t deadline_ns) {
  pollfd p{fd_, read_events(), 0};
  const int64_t left = deadline_ns == INT64_MAX ? -1 : std::max<int64_t>(0, deadline_ns - now_ns());
  timespec ts{static_cast<time_t>(left / 1000000000), static_cast<long>(left % 1000000000)};
  const int rc = ::ppoll(&p, 1, left < 0 ? nullptr : &ts, nullptr);
  return rc < 0 && errno != EINTR ? -errno : 0;
}

int64_t TcpLink::next(int64_t timeout_ns, const char** bytes, shim_msg_info* info) {
  const int64_t deadline = timeout_ns < 0 ? INT64_MAX : now_ns() + timeout_ns;
  bool polled = false;
  pending_ = 0;
  for (;;) {
    const size_t avail = tail_ - head_;
    const auto* p = reinterpret_cast<const uint8_t*>(buf_ + head_);
    if (avail >= SHIM_WIRE_HEADER) {
      prologue_check(wire_, p, avail, info);
      // a bad header, or a message the buffer cannot hold (a WRITE's payload): Python's
      if (info->msg_len == 0 || info->msg_len > cap_) {
        *bytes = buf_ + head_;
        info->status = 1;
        return static_cast<int64_t>(avail);
      }
      if (info->msg_len <= avail) {
        *bytes = buf_ + head_;
        pending_ = info->msg_len;
        return static_cast<int64_t>(info->msg_len);
      }
    }
    const int64_t got = read_more();
    if (got > 0) {
      if (polled) pause_ns_ = kContendedPauseNs;  // polling caught it: the core is ours again
      continue;
    }
    if (got == 0) return -ECONNRESET;  // the peer's end (with or without a message begun)
    if (got != -EAGAIN) return got;
    if (avail > 0) {  // a message begun, its rest on the way: Python reads it as before
      info->status = 1;  // all the loop looks at before it hands a message over
      *bytes = buf_ + head_;
      return static_cast<int64_t>(avail);
    }
    const int64_t now = now_ns();
    if (now >= deadline) return -ETIMEDOUT;
    if (now >= paused_until_ns_ && now - last_traffic_ns_.load(std::memory_order_relaxed) < poll_ns_) {
      sched_yield();  // after traffic: the next message usually comes within the window
      const int64_t after = now_ns();
      polled = after - now <= poll_ns_;
      if (!polled) {  // the core went to others' work: block (see tcp_poll.py)
        paused_until_ns_ = after + pause_ns_;
        pause_ns_ = std::min(kContendedPauseMaxNs, 2 * pause_ns_);
      }
      continue;
    }
    polled = false;  // what comes after this block was not caught by polling
    const int rc = wait_readable(deadline);
    if (rc < 0) return rc;
  }
}

void TcpLink::consumed() {
  head_ += pending_;
  rx_messages_.fetch_add(1, std::memory_order_relaxed);
  rx_bytes_.fetch_add(static_cast<int64_t>(pending_), std::memory_order_relaxed);
  pending_ = 0;
}

std::tuple<int64_t, int64_t, int64_t, int64_t> TcpLink::take_counts() {
  return {rx_messages_.exchange(0), rx_bytes_.exchange(0), tx_messages_.exchange(0), tx_bytes_.exchange(0)};
}

int TcpLink::send(uint8_t type, uint32_t req_id, const std::string& meta, const void* payload, size_t nbytes) {
  shim_iov payload_iov{const_cast<void*>(payload), nbytes};
  const int n = payload != nullptr ? 1 : 0;
  send_buf_.resize(SHIM_WIRE_HEADER + 8 * n + meta.size());
  const int64_t plen = shim_wire_encode(&wire_, send_buf_.data(), send_buf_.size(), type, 0, req_id, meta.data(),
                                        static_cast<uint32_t>(meta.size()), &payload_iov, n);
  if (plen < 0) return static_cast<int>(plen);
  iovec iov[2] = {{send_buf_.data(), static_cast<size_t>(plen)}, {const_cast<void*>(payload), n ? nbytes : 0}};
  std::unique_lock<std::mutex> lock(fd_mu_);
  const int rc = raw_write(iov, n && nbytes > 0 ? 2 : 1, now_ns() + stall_ns_, lock);
  if (rc < 0) return rc;
  last_traffic_ns_.store(now_ns(), std::memory_order_relaxed);
  tx_messages_.fetch_add(1, std::memory_order_relaxed);
  tx_bytes_.fetch_add(plen + static_cast<int64_t>(n ? nbytes : 0), std::memory_order_relaxed);
  return 0;
}

int TcpLink::raw_write(iovec* iov, int n, int64_t deadline_ns, std::unique_lock<std::mutex>& /*fd_lock*/) {
  msghdr msg{};
  msg.msg_iov = iov;
  msg.msg_iovlen = n;
  while (msg.msg_iovlen > 0) {
    const ssize_t wrote = ::sendmsg(fd_, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (wrote < 0) {
      if (errno == EINTR) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK) return -errno;
      if (now_ns() >= deadline_ns) return -ETIMEDOUT;  // the client stopped reading
      pollfd p{fd_, POLLOUT, 0};
      ::poll(&p, 1, 10);
      continue;
    }
    size_t sent = static_cast<size_t>(wrote);
    while (msg.msg_iovlen > 0 && sent >= msg.msg_iov[0].iov_len) {
      sent -= msg.msg_iov[0].iov_len;
      ++msg.msg_iov;
      --msg.msg_iovlen;
    }
    if (msg.msg_iovlen > 0) {
      msg.msg_iov[0].iov_base = static_cast<char*>(msg.msg_iov[0].iov_base) + sent;
      msg.msg_iov[0].iov_len -= sent;
    }
  }
  return 0;
}

} // namespace remote_accel::server
