/* A TLS transport's calls into OpenSSL that Python would make slowly: reads of as many
 * records as are there, in one call without the GIL; and batching records into fewer
 * syscalls (openssl_calls.h: ra_ssl_batch_records, ra_ssl_flush).
 *
 * OpenSSL's SSL_read returns one record (at most 16 KiB) per call, and through Python's
 * `ssl` each call costs a few microseconds of Python around it: a fifth to a third of the
 * time a large message takes to arrive over TLS on the project's VM. This reads records
 * into the caller's buffer until it is full or the socket has nothing more, with the
 * SSL object and OpenSSL's functions that dataplane/tls.py found (Python's own object,
 * through the addresses Python's `_ssl` module resolves: the same library made it). The
 * caller holds the transport's lock around every call into the object, and a reference to
 * its Python owner, so the object outlives the call.
 *
 * Anything but data or "would block" (the peer's end, an error) returns -1 without
 * reading: the caller then makes Python's own call, which meets the same state and
 * reports it in Python's words (EOF as 0, an SSLError).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <limits.h>
#include <string.h>
#include <stdint.h>

#include "openssl_calls.h"

/* read_into(ssl, read, get_error, clear_error, buffer) -> bytes read (> 0), or -2: nothing
 * there (SSL_ERROR_WANT_READ), -3: TLS must write first (WANT_WRITE), -1: something else */
static PyObject* read_into(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  (void)self;
  if (nargs != 5) {
    PyErr_SetString(PyExc_TypeError, "read_into(ssl, read, get_error, clear_error, buffer)");
    return NULL;
  }
  void* ssl = PyLong_AsVoidPtr(args[0]);
  ra_ssl_read_fn read = (ra_ssl_read_fn)PyLong_AsVoidPtr(args[1]);
  ra_ssl_get_error_fn get_error = (ra_ssl_get_error_fn)PyLong_AsVoidPtr(args[2]);
  ra_err_clear_error_fn clear_error = (ra_err_clear_error_fn)PyLong_AsVoidPtr(args[3]);
  if (PyErr_Occurred()) return NULL;
  if (ssl == NULL || read == NULL || get_error == NULL || clear_error == NULL) {
    PyErr_SetString(PyExc_ValueError, "read_into needs the SSL object and OpenSSL's functions");
    return NULL;
  }
  Py_buffer view;
  if (PyObject_GetBuffer(args[4], &view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) return NULL;
  Py_ssize_t got = 0;
  int status = 0;
  char* dst = (char*)view.buf;
  Py_BEGIN_ALLOW_THREADS
  while (got < view.len) {
    const Py_ssize_t left = view.len - got;
    clear_error(); /* SSL_get_error reads this thread's error queue */
    const int n = read(ssl, dst + got, left > INT_MAX ? INT_MAX : (int)left);
    if (n > 0) {
      got += n;
      continue;
    }
    const int err = get_error(ssl, n);
    status = err == RA_SSL_ERROR_WANT_READ ? -2 : err == RA_SSL_ERROR_WANT_WRITE ? -3 : -1;
    break;
  }
  Py_END_ALLOW_THREADS
  PyBuffer_Release(&view);
  return PyLong_FromSsize_t(got > 0 ? got : status);
}

/* The ra_ssl_batching of a tuple of addresses in its field order; 0 with an exception set. */
static int batching_of(PyObject* calls, struct ra_ssl_batching* out) {
  enum { N = sizeof(struct ra_ssl_batching) / sizeof(void*) };
  if (!PyTuple_Check(calls) || PyTuple_GET_SIZE(calls) != N) {
    PyErr_Format(PyExc_TypeError, "the batching calls are a tuple of %d addresses", (int)N);
    return 0;
  }
  void* slots[N];
  for (Py_ssize_t i = 0; i < N; i++) {
    slots[i] = PyLong_AsVoidPtr(PyTuple_GET_ITEM(calls, i));
    if (slots[i] == NULL) {
      if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "an OpenSSL function's address is 0");
      return 0;
    }
  }
  memcpy(out, slots, sizeof(*out)); /* the struct is N function pointers, in this order */
  return 1;
}

/* The (ssl, calls) arguments of batch_records and flush; 0 with an exception set. */
static int ssl_and_calls(PyObject* const* args, Py_ssize_t nargs, const char* usage, void** ssl,
                         struct ra_ssl_batching* calls) {
  if (nargs != 2) {
    PyErr_SetString(PyExc_TypeError, usage);
    return 0;
  }
  *ssl = PyLong_AsVoidPtr(args[0]);
  if (*ssl == NULL || !batching_of(args[1], calls)) {
    if (!PyErr_Occurred()) PyErr_Format(PyExc_ValueError, "%s needs the SSL object", usage);
    return 0;
  }
  return 1;
}

/* batch_records(ssl, calls) -> True, or False where OpenSSL refused (nothing changed) */
static PyObject* batch_records(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  (void)self;
  void* ssl;
  struct ra_ssl_batching calls;
  if (!ssl_and_calls(args, nargs, "batch_records(ssl, calls)", &ssl, &calls)) return NULL;
  return PyBool_FromLong(ra_ssl_batch_records(ssl, &calls));
}

/* flush(ssl, calls) -> 1 sent, 0 the socket is full (wait, then again), -1 an error */
static PyObject* flush(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  (void)self;
  void* ssl;
  struct ra_ssl_batching calls;
  if (!ssl_and_calls(args, nargs, "flush(ssl, calls)", &ssl, &calls)) return NULL;
  int rc;
  Py_BEGIN_ALLOW_THREADS
  rc = ra_ssl_flush(ssl, &calls);
  Py_END_ALLOW_THREADS
  return PyLong_FromLong(rc);
}

static PyMethodDef methods[] = {
    {"read_into", (PyCFunction)(void (*)(void))read_into, METH_FASTCALL,
     "read_into(ssl, read, get_error, clear_error, buffer): TLS records into buffer until it is full or "
     "nothing more is there; bytes read, or -2 (would block), -3 (must write first), -1 (anything else: make "
     "Python's own call)."},
    {"batch_records", (PyCFunction)(void (*)(void))batch_records, METH_FASTCALL,
     "batch_records(ssl, calls): after the handshake, the SSL object writes through a buffer and reads ahead "
     "(openssl_calls.h, ra_ssl_batch_records); calls: the addresses of struct ra_ssl_batching's functions, in "
     "its order. False where OpenSSL refused (nothing changed)."},
    {"flush", (PyCFunction)(void (*)(void))flush, METH_FASTCALL,
     "flush(ssl, calls): send what the write buffer holds; 1 sent, 0 the socket is full (wait until it is "
     "writable, then flush again), -1 an error."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_tls_io", NULL, -1, methods};

PyMODINIT_FUNC PyInit__tls_io(void) { return PyModule_Create(&module); }
