// A TLS session's socket as a Link of the C++ receive loop: a TcpLink whose byte stream is
// the one OpenSSL decrypts, so that a TLS session's sync points and batches are served
// without the GIL as a plain TCP session's are (issue #36).
//
// The SSL object is Python's own (the `ssl` module's, after its handshake): Python's recv
// and the loop read the same record stream through the same read-ahead buffer, taking turns
// as tcp_link.h says. OpenSSL's functions are called through the addresses Python's
// `_ssl` module resolves (dataplane/tls.py: native_link), so this module links nothing of
// OpenSSL and always calls the library that made the object.
//
// An SSL object must not be used by two threads at once. Here: the loop's reads and sends
// and the heartbeat's sends (under the loop's send mutex) take fd_mu_; Python takes the
// transport's own lock around its calls and around the heartbeat's C++ send
// (TlsTransport.send_locked); Python's reads and the loop's run in the same thread.
//
// The SSL object reads and writes this link's dup of the socket while the link is open
// (SSL_set_fd), so a close() of Python's socket by another thread never leaves it a reused
// descriptor; close() points it back at Python's socket. Either way it writes through a
// buffer (ra_ssl_buffer_writes, flushed after each reply); reads ahead as Python set it. Python keeps the SSL object alive
// as long as the transport (TlsTransport._native_ssl).
#pragma once

#include "tcp_link.h"

extern "C" {
#include "openssl_calls.h"
}

#include <cstdint>
#include <vector>

namespace remote_accel::server {

// OpenSSL's functions this link calls, by address.
struct SslFunctions {
  ra_ssl_read_fn read;
  ra_ssl_write_fn write;
  ra_ssl_get_error_fn get_error;
  ra_ssl_set_fd_fn set_fd;
  ra_err_clear_error_fn clear_error;
  ra_err_peek_error_fn peek_error;
  ra_ssl_batching batching;  // records many to a syscall (openssl_calls.h)
};

class TlsLink : public TcpLink {
 public:
  // fd...stall_ns: as TcpLink's; ssl: the SSL object of the transport's socket `fd`.
  TlsLink(int fd, uintptr_t buffer, size_t capacity, const shim_wire& wire, int64_t poll_ns, int64_t stall_ns,
          uintptr_t ssl, const SslFunctions& fns);
  ~TlsLink() override;

  void close() override;

 protected:
  int64_t raw_read(char* dst, size_t cap) override;
  int raw_write(iovec* iov, int n, int64_t deadline_ns, std::unique_lock<std::mutex>& fd_lock) override;
  short read_events() const override;

 private:
  // -errno (0: the peer's end) for a failed call whose SSL_get_error is `err` (errno right
  // after the call: call_errno); -EAGAIN to retry once the socket is readable (or
  // writable: want_write_).
  int64_t failure(int err, int call_errno);
  // Sends what the write buffer holds (a reply's records): 0, or -errno (-ETIMEDOUT past
  // deadline_ns); waits for the socket with fd_lock released, as raw_write does.
  int flush(int64_t deadline_ns, std::unique_lock<std::mutex>& fd_lock);

  void* ssl_;
  int python_fd_;
  SslFunctions fns_;
  std::vector<uint8_t> record_;  // a reply gathered into one TLS record
  bool want_write_ = false;  // TLS must write before it can read on (a key update's answer)
};

} // namespace remote_accel::server
