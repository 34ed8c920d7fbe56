// A TCP session's socket for the C++ receive loop: tcp_link.h says how it shares the
// transport's read-ahead buffer with Python.
#include "tcp_link.h"

#include <poll.h>
#include <sched.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstring>
#include <stdexcept>

namespace remote_accel::server {

namespace {

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch()).count();
}

uint16_t get16(const uint8_t* p) { return static_cast<uint16_t>(p[0] << 8 | p[1]); }
uint32_t get32(const uint8_t* p) {
  return static_cast<uint32_t>(p[0]) << 24 | static_cast<uint32_t>(p[1]) << 16 | static_cast<uint32_t>(p[2]) << 8 | p[3];
}
uint64_t get64(const uint8_t* p) { return static_cast<uint64_t>(get32(p)) << 32 | get32(p + 4); }
void put16(uint8_t* p, uint16_t v) { p[0] = static_cast<uint8_t>(v >> 8); p[1] = static_cast<uint8_t>(v); }
void put32(uint8_t* p, uint32_t v) {
  for (int i = 3; i >= 0; --i, v >>= 8) p[i] = static_cast<uint8_t>(v);
}
void put64(uint8_t* p, uint64_t v) {
  put32(p, static_cast<uint32_t>(v >> 32));
  put32(p + 4, static_cast<uint32_t>(v));
}

// CRC32C (Castagnoli, reflected 0x82F63B78), a byte at a time: prologues are a few
// hundred bytes; payloads are TCP's to protect (wire.py).
constexpr std::array<uint32_t, 256> make_crc_table() {
  std::array<uint32_t, 256> t{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
    t[i] = c;
  }
  return t;
}
constexpr std::array<uint32_t, 256> kCrcTable = make_crc_table();

constexpr size_t kCrcOffset = 24;

} // namespace

uint32_t crc32c(uint32_t crc, const uint8_t* data, size_t n) {
  crc = ~crc;
  for (size_t i = 0; i < n; ++i) crc = kCrcTable[(crc ^ data[i]) & 0xFF] ^ (crc >> 8);
  return ~crc;
}

void wire_check(const WireParams& w, const uint8_t* p, uint64_t len, shim_msg_info* out) {
  std::memset(out, 0, sizeof(*out));
  out->status = 1;  // not (yet) known good: Python's wire.py looks and says what is wrong
  if (len < kWireHeader || p[0] != w.magic0 || p[1] != w.magic1 || p[2] != w.version) return;
  out->type = p[3];
  out->flags = get16(p + 4);
  out->n_payloads = get16(p + 6);
  out->req_id = get32(p + 8);
  out->meta_len = get32(p + 12);
  out->payload_total = get64(p + 16);
  out->crc = get32(p + 24);
  if (out->meta_len > w.max_meta || out->n_payloads > w.max_payloads || out->payload_total > w.max_payload_total) {
    return;
  }
  const uint64_t plen = kWireHeader + 8ull * out->n_payloads + out->meta_len;
  out->prologue_len = static_cast<uint32_t>(plen);
  out->msg_len = plen + out->payload_total;
  if (plen > len) return;  // the caller reads more, or leaves it to Python
  uint64_t total = 0;
  for (uint32_t i = 0; i < out->n_payloads; ++i) total += get64(p + kWireHeader + 8 * i);
  if (total != out->payload_total) return;
  uint8_t zeroed[kWireHeader];
  std::memcpy(zeroed, p, kWireHeader);
  std::memset(zeroed + kCrcOffset, 0, 4);
  const uint32_t crc = crc32c(crc32c(0, zeroed, kWireHeader), p + kWireHeader, plen - kWireHeader);
  if (crc != out->crc) return;
  out->status = 0;
}

size_t wire_encode(const WireParams& w, uint8_t* out, uint8_t type, uint32_t req_id, const std::string& meta,
                   const uint64_t* payload_len) {
  const uint16_t n = payload_len != nullptr ? 1 : 0;
  const size_t plen = kWireHeader + 8u * n + meta.size();
  out[0] = w.magic0;
  out[1] = w.magic1;
  out[2] = w.version;
  out[3] = type;
  put16(out + 4, 0);  // flags
  put16(out + 6, n);
  put32(out + 8, req_id);
  put32(out + 12, static_cast<uint32_t>(meta.size()));
  put64(out + 16, n ? *payload_len : 0);
  put32(out + kCrcOffset, 0);
  if (n) put64(out + kWireHeader, *payload_len);
  std::memcpy(out + kWireHeader + 8u * n, meta.data(), meta.size());
  put32(out + kCrcOffset, crc32c(0, out, plen));
  return plen;
}

TcpLink::TcpLink(int fd, uintptr_t buffer, size_t capacity, const WireParams& wire, int64_t poll_ns,
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
  for (;;) {
    const ssize_t n = ::recv(fd_, buf_ + tail_, cap_ - tail_, MSG_DONTWAIT);
    if (n > 0) {
      tail_ += static_cast<size_t>(n);
      last_traffic_ns_.store(now_ns(), std::memory_order_relaxed);
      return n;
    }
    if (n == 0) return 0;
    if (errno == EINTR) continue;
    return (errno == EWOULDBLOCK) ? -EAGAIN : -errno;
  }
}

int TcpLink::wait_readable(int64_t deadline_ns) {
  pollfd p{fd_, POLLIN, 0};
  const int64_t left = deadline_ns == INT64_MAX ? -1 : std::max<int64_t>(0, deadline_ns - now_ns());
  timespec ts{static_cast<time_t>(left / 1000000000), static_cast<long>(left % 1000000000)};
  const int rc = ::ppoll(&p, 1, left < 0 ? nullptr : &ts, nullptr);
  return rc < 0 && errno != EINTR ? -errno : 0;
}

int64_t TcpLink::next(int64_t timeout_ns, const char** bytes, shim_msg_info* info) {
  const int64_t deadline = timeout_ns < 0 ? INT64_MAX : now_ns() + timeout_ns;
  pending_ = 0;
  for (;;) {
    const size_t avail = tail_ - head_;
    const auto* p = reinterpret_cast<const uint8_t*>(buf_ + head_);
    if (avail >= kWireHeader) {
      wire_check(wire_, p, avail, info);
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
    if (got > 0) continue;
    if (got == 0) return -ECONNRESET;  // the peer's end (with or without a message begun)
    if (got != -EAGAIN) return got;
    if (avail > 0) {  // a message begun, its rest on the way: Python reads it as before
      wire_check(wire_, reinterpret_cast<const uint8_t*>(buf_ + head_), avail, info);
      info->status = 1;
      *bytes = buf_ + head_;
      return static_cast<int64_t>(avail);
    }
    const int64_t now = now_ns();
    if (now >= deadline) return -ETIMEDOUT;
    if (now - last_traffic_ns_.load(std::memory_order_relaxed) < poll_ns_) {
      sched_yield();  // after traffic: the next message usually comes within the window
      continue;
    }
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
  const uint64_t len = nbytes;
  send_buf_.resize(kWireHeader + 8 + meta.size());
  const size_t plen = wire_encode(wire_, send_buf_.data(), type, req_id, meta, payload != nullptr ? &len : nullptr);
  iovec iov[2] = {{send_buf_.data(), plen}, {const_cast<void*>(payload), payload != nullptr ? nbytes : 0}};
  msghdr msg{};
  msg.msg_iov = iov;
  msg.msg_iovlen = payload != nullptr && nbytes > 0 ? 2 : 1;
  const int64_t deadline = now_ns() + stall_ns_;
  std::lock_guard<std::mutex> lock(fd_mu_);
  while (msg.msg_iovlen > 0) {
    const ssize_t n = ::sendmsg(fd_, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK) return -errno;
      if (now_ns() >= deadline) return -ETIMEDOUT;  // the client stopped reading
      pollfd p{fd_, POLLOUT, 0};
      ::poll(&p, 1, 10);
      continue;
    }
    size_t sent = static_cast<size_t>(n);
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
  last_traffic_ns_.store(now_ns(), std::memory_order_relaxed);
  tx_messages_.fetch_add(1, std::memory_order_relaxed);
  tx_bytes_.fetch_add(static_cast<int64_t>(plen + (payload != nullptr ? nbytes : 0)), std::memory_order_relaxed);
  return 0;
}

} // namespace remote_accel::server
