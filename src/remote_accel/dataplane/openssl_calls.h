/* OpenSSL as remote_accel calls it by address: the functions and values of Python's own
 * OpenSSL (dataplane/tls.py finds them through Python's `_ssl` module, and the SSL object
 * inside `ssl`'s socket), so that nothing here links against OpenSSL. One home for both
 * callers: the TLS transport's calls in C (_tls_io.c) and a server's TLS link (server/csrc/tls_link.h).
 * The signatures and values are OpenSSL's stable ABI (1.1 and 3.x). */
#ifndef REMOTE_ACCEL_OPENSSL_CALLS_H
#define REMOTE_ACCEL_OPENSSL_CALLS_H

#include <stddef.h>

typedef int (*ra_ssl_read_fn)(void* ssl, void* buf, int num);
typedef int (*ra_ssl_write_fn)(void* ssl, const void* buf, int num);
typedef int (*ra_ssl_get_error_fn)(const void* ssl, int ret);
typedef int (*ra_ssl_set_fd_fn)(void* ssl, int fd);
typedef void (*ra_err_clear_error_fn)(void);
typedef unsigned long (*ra_err_peek_error_fn)(void);

/* What batches records into fewer syscalls (ra_ssl_batch_records below) */
typedef const void* (*ra_bio_f_buffer_fn)(void);
typedef void* (*ra_bio_new_fn)(const void* method);
typedef int (*ra_bio_free_fn)(void* bio);
typedef int (*ra_bio_up_ref_fn)(void* bio);
typedef void* (*ra_bio_push_fn)(void* bio, void* next);
typedef long (*ra_bio_ctrl_fn)(void* bio, int cmd, long larg, void* parg);
typedef long (*ra_bio_int_ctrl_fn)(void* bio, int cmd, long larg, int iarg);
typedef int (*ra_bio_test_flags_fn)(const void* bio, int flags);
typedef void* (*ra_ssl_get_wbio_fn)(const void* ssl);
typedef void (*ra_ssl_set0_wbio_fn)(void* ssl, void* wbio);
typedef void (*ra_ssl_set_read_ahead_fn)(void* ssl, int yes);
typedef void (*ra_ssl_set_default_read_buffer_len_fn)(void* ssl, size_t len);
typedef int (*ra_ssl_free_buffers_fn)(void* ssl);

struct ra_ssl_batching {
  ra_bio_f_buffer_fn f_buffer;
  ra_bio_new_fn bio_new;
  ra_bio_free_fn bio_free;
  ra_bio_up_ref_fn up_ref;
  ra_bio_push_fn push;
  ra_bio_ctrl_fn ctrl;
  ra_bio_int_ctrl_fn int_ctrl;
  ra_bio_test_flags_fn test_flags;
  ra_ssl_get_wbio_fn get_wbio;
  ra_ssl_set0_wbio_fn set0_wbio;
  ra_ssl_set_read_ahead_fn set_read_ahead;
  ra_ssl_set_default_read_buffer_len_fn set_default_read_buffer_len;
  ra_ssl_free_buffers_fn free_buffers;
};

/* bio.h's values */
#define RA_BIO_CTRL_FLUSH 11
#define RA_BIO_C_SET_BUFF_SIZE 117
#define RA_BIO_FLAGS_SHOULD_RETRY 0x08

/* Writes of this much at most, reads of this much at most: see ra_ssl_batch_records */
#define RA_TLS_WRITE_BUFFER (256 * 1024)
#define RA_TLS_READ_BUFFER (64 * 1024)

/* The SSL object writes through a buffering BIO of RA_TLS_WRITE_BUFFER over its write BIO
 * (a sender flushes it after each message: ra_ssl_flush). Again after each SSL_set_fd,
 * which replaces the BIOs. Returns 1, or 0 where a call failed and the object is as it was. */
static inline int ra_ssl_buffer_writes(void* ssl, const struct ra_ssl_batching* f) {
  void* sock = f->get_wbio(ssl);
  if (sock == NULL) return 0;
  void* buffer = f->bio_new(f->f_buffer());
  if (buffer == NULL) return 0;
  if (f->int_ctrl(buffer, RA_BIO_C_SET_BUFF_SIZE, RA_TLS_WRITE_BUFFER, 1) != 1 || f->up_ref(sock) != 1) {
    f->bio_free(buffer);
    return 0;
  }
  /* the chain takes the new reference to the socket BIO, the SSL object the chain (and
   * drops its own reference as write BIO; it keeps the one as read BIO) */
  f->push(buffer, sock);
  f->set0_wbio(ssl, buffer);
  return 1;
}

/* Batch TLS records into fewer syscalls. OpenSSL writes each record (16 KiB at most) with
 * a write of its own and, without read-ahead, reads each with two (its header, then its
 * body): a bulk transfer over loopback spent more time in the kernel's per-call work than
 * in AES-GCM. Here the SSL object writes through a buffer (ra_ssl_buffer_writes) and reads
 * ahead into a buffer of RA_TLS_READ_BUFFER: many records a syscall each way. Read-ahead
 * keeps records in OpenSSL's buffer that the socket no longer shows as readable, which is
 * safe where every reader reads until SSL_read wants more before it waits for the socket
 * (ours do). Right after the handshake only: its read buffer, freed here so that the next
 * read makes a larger one, then holds nothing (the handshake read record by record; a
 * buffer freed with a record half read is CVE-2024-4741 in OpenSSLs before 3.0.14).
 * Returns 1, or 0 where the write buffer could not be set (reads are batched anyway). */
static inline int ra_ssl_batch_records(void* ssl, const struct ra_ssl_batching* f) {
  f->set_read_ahead(ssl, 1);
  f->set_default_read_buffer_len(ssl, RA_TLS_READ_BUFFER);
  f->free_buffers(ssl);
  return ra_ssl_buffer_writes(ssl, f);
}

/* Sends what the write BIO holds: 1 when all of it left (or nothing was held, or the BIO
 * buffers nothing), 0 when the socket is full (wait until it is writable, then call
 * again), -1 on an error. */
static inline int ra_ssl_flush(void* ssl, const struct ra_ssl_batching* f) {
  void* wbio = f->get_wbio(ssl);
  if (wbio == NULL) return -1;
  if (f->ctrl(wbio, RA_BIO_CTRL_FLUSH, 0, NULL) > 0) return 1;
  return f->test_flags(wbio, RA_BIO_FLAGS_SHOULD_RETRY) ? 0 : -1;
}

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
