/* TLS reads in C: as many records as are there, in one call without the GIL.
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

static PyMethodDef methods[] = {
    {"read_into", (PyCFunction)(void (*)(void))read_into, METH_FASTCALL,
     "read_into(ssl, read, get_error, clear_error, buffer): TLS records into buffer until it is full or "
     "nothing more is there; bytes read, or -2 (would block), -3 (must write first), -1 (anything else: make "
     "Python's own call)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_tls_reads", NULL, -1, methods};

PyMODINIT_FUNC PyInit__tls_reads(void) { return PyModule_Create(&module); }
