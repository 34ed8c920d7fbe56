/* codec.decode in C: the same format, the same bounds, the same values.
 *
 * The server decodes every message that is not a plain Batch in Python: a compiled
 * graph's call (RunGraph, ~100 tensor references) took about a seventh of a CPU server's
 * time in a compiled training step (py-spy), nearly all of it in codec._Decoder.read.
 * This builds the very objects the Python decoder builds (None, bool, int, float,
 * complex, str, bytes, list, tuple, dict with str keys, codec.Ext), with its checks:
 * every length against what is left of the input, nesting depth, item counts.
 *
 * Malformed input raises ValueError with no detail: codec.decode then runs the Python
 * decoder on the same bytes, which raises the ProtocolError that says what is wrong, so
 * there is one place that words the errors.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

/* codec.py: MAX_DEPTH, MAX_ITEMS, _SMALL_BIAS and the tags, in that order */
#define MAX_DEPTH 64
#define MAX_ITEMS (1 << 22)
#define SMALL_BIAS 128
enum { T_NONE, T_FALSE, T_TRUE, T_INT, T_FLOAT, T_STR, T_BYTES, T_LIST, T_TUPLE, T_DICT, T_COMPLEX, T_EXT, T_SMALLINT };

typedef struct {
  const uint8_t* buf;
  Py_ssize_t len;
  Py_ssize_t items;
  PyTypeObject* ext; /* codec.Ext, a tuple subclass */
} Decoder;

static PyObject* malformed(void) {
  PyErr_SetNone(PyExc_ValueError);
  return NULL;
}

static int need(const Decoder* d, Py_ssize_t pos, Py_ssize_t n) { return n <= d->len - pos; }

static uint32_t read_u32(const uint8_t* p) {
  uint32_t v;
  memcpy(&v, p, 4); /* the wire is little-endian, as this host (setup checks it) */
  return v;
}

static PyObject* read_value(Decoder* d, Py_ssize_t* pos, int depth);

static PyObject* read_items(Decoder* d, Py_ssize_t* pos, int depth, uint8_t tag) {
  if (!need(d, *pos, 4)) return malformed();
  const Py_ssize_t n = read_u32(d->buf + *pos);
  *pos += 4;
  /* every item takes at least one byte: reject counts the input cannot hold */
  if (!need(d, *pos, n)) return malformed();
  d->items += n;
  if (d->items > MAX_ITEMS) return malformed();
  if (tag == T_DICT) {
    PyObject* out = PyDict_New();
    if (out == NULL) return NULL;
    for (Py_ssize_t i = 0; i < n; ++i) {
      PyObject* key = read_value(d, pos, depth + 1);
      if (key != NULL && !PyUnicode_CheckExact(key)) {
        Py_CLEAR(key);
        malformed();
      }
      if (key == NULL) {
        Py_DECREF(out);
        return NULL;
      }
      PyObject* value = read_value(d, pos, depth + 1);
      const int failed = value == NULL || PyDict_SetItem(out, key, value) < 0;
      Py_DECREF(key);
      Py_XDECREF(value);
      if (failed) {
        Py_DECREF(out);
        return NULL;
      }
    }
    return out;
  }
  PyObject* out = tag == T_LIST ? PyList_New(n) : PyTuple_New(n);
  if (out == NULL) return NULL;
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* item = read_value(d, pos, depth + 1);
    if (item == NULL) {
      Py_DECREF(out);
      return NULL;
    }
    if (tag == T_LIST) {
      PyList_SET_ITEM(out, i, item);
    } else {
      PyTuple_SET_ITEM(out, i, item);
    }
  }
  return out;
}

static PyObject* read_ext(Decoder* d, Py_ssize_t* pos, int depth) {
  if (!need(d, *pos, 1)) return malformed();
  PyObject* code = PyLong_FromLong(d->buf[*pos]);
  if (code == NULL) return NULL;
  *pos += 1;
  PyObject* value = read_value(d, pos, depth + 1);
  if (value == NULL) {
    Py_DECREF(code);
    return NULL;
  }
  PyObject* fields = PyTuple_Pack(2, code, value);
  Py_DECREF(code);
  Py_DECREF(value);
  if (fields == NULL) return NULL;
  /* Ext(code, value) without running the NamedTuple's Python __new__: tuple's own */
  PyObject* args = PyTuple_Pack(1, fields);
  Py_DECREF(fields);
  if (args == NULL) return NULL;
  PyObject* ext = PyTuple_Type.tp_new(d->ext, args, NULL);
  Py_DECREF(args);
  return ext;
}

static PyObject* read_value(Decoder* d, Py_ssize_t* pos, int depth) {
  if (depth > MAX_DEPTH || !need(d, *pos, 1)) return malformed();
  const uint8_t tag = d->buf[*pos];
  *pos += 1;
  const uint8_t* p = d->buf + *pos;
  switch (tag) {
    case T_SMALLINT:
      if (!need(d, *pos, 1)) return malformed();
      *pos += 1;
      return PyLong_FromLong((long)p[0] - SMALL_BIAS);
    case T_NONE:
      Py_RETURN_NONE;
    case T_FALSE:
      Py_RETURN_FALSE;
    case T_TRUE:
      Py_RETURN_TRUE;
    case T_INT: {
      if (!need(d, *pos, 8)) return malformed();
      int64_t v;
      memcpy(&v, p, 8);
      *pos += 8;
      return PyLong_FromLongLong(v);
    }
    case T_FLOAT: {
      if (!need(d, *pos, 8)) return malformed();
      double v;
      memcpy(&v, p, 8);
      *pos += 8;
      return PyFloat_FromDouble(v);
    }
    case T_COMPLEX: {
      if (!need(d, *pos, 16)) return malformed();
      double re, im;
      memcpy(&re, p, 8);
      memcpy(&im, p + 8, 8);
      *pos += 16;
      return PyComplex_FromDoubles(re, im);
    }
    case T_STR:
    case T_BYTES: {
      if (!need(d, *pos, 4)) return malformed();
      const Py_ssize_t n = read_u32(p);
      *pos += 4;
      if (!need(d, *pos, n)) return malformed();
      const char* s = (const char*)d->buf + *pos;
      *pos += n;
      if (tag == T_BYTES) return PyBytes_FromStringAndSize(s, n);
      PyObject* text = PyUnicode_DecodeUTF8(s, n, "strict");
      if (text == NULL && PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) {
        PyErr_Clear();
        return malformed();
      }
      return text;
    }
    case T_LIST:
    case T_TUPLE:
    case T_DICT:
      return read_items(d, pos, depth, tag);
    case T_EXT:
      return read_ext(d, pos, depth);
    default:
      return malformed();
  }
}

/* decode_at(data, pos, ext) -> (value, end): the value that starts at byte `pos`. */
static PyObject* decode_at(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  (void)self;
  if (nargs != 3 || !PyType_Check(args[2]) || !PyType_IsSubtype((PyTypeObject*)args[2], &PyTuple_Type)) {
    PyErr_SetString(PyExc_TypeError, "decode_at(data, pos, ext): ext must be a tuple subclass");
    return NULL;
  }
  const Py_ssize_t start = PyLong_AsSsize_t(args[1]);
  if (start == -1 && PyErr_Occurred()) return NULL;
  Py_buffer view;
  if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0) return NULL;
  PyObject* result = NULL;
  if (start < 0 || start > view.len) {
    malformed();
  } else {
    Decoder d = {(const uint8_t*)view.buf, view.len, 0, (PyTypeObject*)args[2]};
    Py_ssize_t pos = start;
    PyObject* value = read_value(&d, &pos, 0);
    if (value != NULL) {
      result = Py_BuildValue("(Nn)", value, pos);
    }
  }
  PyBuffer_Release(&view);
  return result;
}

static PyMethodDef methods[] = {
    {"decode_at", (PyCFunction)(void (*)(void))decode_at, METH_FASTCALL,
     "decode_at(data, pos, ext) -> (value, end). Malformed input: ValueError (no detail)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_codec", "codec.decode in C", -1, methods,
                                    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__codec(void) { return PyModule_Create(&module); }
