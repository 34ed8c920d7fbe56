// A TLS session's socket for the C++ receive loop: tls_link.h says whose SSL object it
// uses and how the threads share it.
#include "tls_link.h"

#include <poll.h>

#include <cerrno>
#include <algorithm>
#include <climits>
#include <cstring>
#include <stdexcept>

namespace remote_accel::server {

TlsLink::TlsLink(int fd, uintptr_t buffer, size_t capacity, const shim_wire& wire, int64_t poll_ns,
                 int64_t stall_ns, uintptr_t ssl, const SslFunctions& fns)
    : TcpLink(fd, buffer, capacity, wire, poll_ns, stall_ns),
      ssl_(reinterpret_cast<void*>(ssl)),
      python_fd_(fd),
      fns_(fns) {
  if (ssl_ == nullptr || !fns_.read || !fns_.write || !fns_.get_error || !fns_.set_fd || !fns_.clear_error ||
      !fns_.peek_error) {
    throw std::invalid_argument("TlsLink needs the SSL object and every OpenSSL function");
  }
  ra_ssl_flush(ssl_, &fns_.batching);  // Python flushes after each message: nothing is held
  if (fns_.set_fd(ssl_, fd_) != 1) throw std::runtime_error("SSL_set_fd on the link's socket failed");
  ra_ssl_buffer_writes(ssl_, &fns_.batching);  // set_fd dropped Python's (reads stay batched)
}

TlsLink::~TlsLink() { close(); }

void TlsLink::close() {
  std::lock_guard<std::mutex> lock(fd_mu_);
  if (ssl_ != nullptr) {
    ra_ssl_flush(ssl_, &fns_.batching);  // every reply was flushed: nothing is held
    if (fns_.set_fd(ssl_, python_fd_) == 1) {  // Python's socket again, as before the link
      ra_ssl_buffer_writes(ssl_, &fns_.batching);
    }
    ssl_ = nullptr;
  }
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

int64_t TlsLink::failure(int err, int call_errno) {
  want_write_ = err == RA_SSL_ERROR_WANT_WRITE;
  switch (err) {
    case RA_SSL_ERROR_WANT_READ:
    case RA_SSL_ERROR_WANT_WRITE:
      return -EAGAIN;
    case RA_SSL_ERROR_ZERO_RETURN:  // the peer's close_notify
      return 0;
    case RA_SSL_ERROR_SYSCALL:
      return call_errno != 0 ? -call_errno : 0;  // no errno: the stream ended
    case RA_SSL_ERROR_SSL:  // a peer gone without close_notify is the end of the stream, as Python's
      return (fns_.peek_error() & RA_ERR_REASON_MASK) == RA_SSL_R_UNEXPECTED_EOF_WHILE_READING ? 0 : -EPROTO;
    default:
      return -EPROTO;
  }
}

int64_t TlsLink::raw_read(char* dst, size_t cap) {
  std::lock_guard<std::mutex> lock(fd_mu_);
  if (ssl_ == nullptr) return -EBADF;
  fns_.clear_error();  // SSL_get_error reads this thread's error queue
  errno = 0;
  const int n = fns_.read(ssl_, dst, static_cast<int>(std::min<size_t>(cap, INT_MAX)));
  const int call_errno = errno;
  if (n > 0) {
    want_write_ = false;
    return n;
  }
  return failure(fns_.get_error(ssl_, n), call_errno);
}

short TlsLink::read_events() const { return want_write_ ? POLLIN | POLLOUT : POLLIN; }

int TlsLink::raw_write(iovec* iov, int n, int64_t deadline_ns, std::unique_lock<std::mutex>& fd_lock) {
  // one record for the whole reply (a prologue and at most a small payload)
  record_.clear();
  for (int i = 0; i < n; ++i) {
    const auto* p = static_cast<const uint8_t*>(iov[i].iov_base);
    record_.insert(record_.end(), p, p + iov[i].iov_len);
  }
  for (;;) {
    if (ssl_ == nullptr) return -EBADF;
    fns_.clear_error();
    errno = 0;
    const int wrote = fns_.write(ssl_, record_.data(), static_cast<int>(record_.size()));
    const int call_errno = errno;
    if (wrote > 0) return flush(deadline_ns, fd_lock);  // all of it (no SSL_MODE_ENABLE_PARTIAL_WRITE)
    const int err = fns_.get_error(ssl_, wrote);
    if (err != RA_SSL_ERROR_WANT_READ && err != RA_SSL_ERROR_WANT_WRITE) {
      const int64_t rc = failure(err, call_errno);
      return rc < 0 ? static_cast<int>(rc) : -EPIPE;
    }
    if (now_ns() >= deadline_ns) return -ETIMEDOUT;  // the client stopped reading
    pollfd p{fd_, static_cast<short>(err == RA_SSL_ERROR_WANT_WRITE ? POLLOUT : POLLIN), 0};
    fd_lock.unlock();  // the loop's reads go on meanwhile (a retry repeats the same write)
    ::poll(&p, 1, 10);
    fd_lock.lock();
  }
}

int TlsLink::flush(int64_t deadline_ns, std::unique_lock<std::mutex>& fd_lock) {
  for (;;) {
    if (ssl_ == nullptr) return -EBADF;
    const int sent = ra_ssl_flush(ssl_, &fns_.batching);
    if (sent > 0) return 0;
    if (sent < 0) return -EPIPE;
    if (now_ns() >= deadline_ns) return -ETIMEDOUT;  // the client stopped reading
    pollfd p{fd_, POLLOUT, 0};
    fd_lock.unlock();
    ::poll(&p, 1, 10);
    fd_lock.lock();
  }
}

} // namespace remote_accel::server
