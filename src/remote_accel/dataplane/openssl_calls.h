/* OpenSSL as remote_accel calls it by address: the functions and values of Python's own
 * OpenSSL (dataplane/tls.py finds them through Python's `_ssl` module, and the SSL object
 * inside `ssl`'s socket), so that nothing here links against OpenSSL. One home for both
 * callers: the TLS reads in C (_tls_reads.c) and a server's TLS link (server/csrc/tls_link.h).
 * The signatures and values are OpenSSL's stable ABI (1.1 and 3.x). */
#ifndef REMOTE_ACCEL_OPENSSL_CALLS_H
#define REMOTE_ACCEL_OPENSSL_CALLS_H

typedef int (*ra_ssl_read_fn)(void* ssl, void* buf, int num);
typedef int (*ra_ssl_write_fn)(void* ssl, const void* buf, int num);
typedef int (*ra_ssl_get_error_fn)(const void* ssl, int ret);
typedef int (*ra_ssl_set_fd_fn)(void* ssl, int fd);
typedef void (*ra_err_clear_error_fn)(void);
typedef unsigned long (*ra_err_peek_error_fn)(void);

/* SSL_get_error's answers (ssl.h) */
enum {
  RA_SSL_ERROR_SSL = 1,
  RA_SSL_ERROR_WANT_READ = 2,
  RA_SSL_ERROR_WANT_WRITE = 3,
  RA_SSL_ERROR_SYSCALL = 5,
  RA_SSL_ERROR_ZERO_RETURN = 6,
};

/* ERR_GET_REASON(ERR_peek_error()) of a peer gone without close_notify (err.h, ssl.h:
 * SSL_R_UNEXPECTED_EOF_WHILE_READING) */
#define RA_ERR_REASON_MASK 0x7FFFFFUL
#define RA_SSL_R_UNEXPECTED_EOF_WHILE_READING 294UL

#endif
