/* libFuzzer target: the C codec's decoder (dataplane/_codec.c), which decodes the meta of
 * every message the server's Python handles (RunGraph, Hello, ...) from a peer's bytes.
 *
 * _codec.c builds Python objects, so this embeds CPython and includes the decoder's
 * source, calling its decode_at(data, pos, Ext) as codec.decode does: every value from
 * position 0, and the value after it if there is one (a message's meta is one value; the
 * second call reaches the paths where pos > 0). What must hold: no crash, no leak, no
 * out-of-bounds read (the input is a copy of exactly its bytes), an end position within
 * the input, and a refusal only as ValueError (codec.decode then asks the Python decoder). */
#include "../src/remote_accel/dataplane/_codec.c"

static PyObject *ext_type;

int
LLVMFuzzerInitialize(int *argc, char ***argv)
{
	(void)argc;
	(void)argv;
	Py_InitializeEx(0);
	/* codec.Ext is a NamedTuple (code, value): a tuple subclass is all decode_at needs */
	PyObject *globals = PyDict_New();
	PyDict_SetItemString(globals, "__builtins__", PyEval_GetBuiltins());
	PyObject *r = PyRun_String("class Ext(tuple): pass\n", Py_file_input, globals, globals);
	if (r == NULL) {
		PyErr_Print();
		abort();
	}
	Py_DECREF(r);
	ext_type = PyDict_GetItemString(globals, "Ext");
	Py_INCREF(ext_type);
	Py_DECREF(globals);
	return 0;
}

static Py_ssize_t
decode_once(PyObject *data, Py_ssize_t pos, Py_ssize_t size)
{
	PyObject *args[3] = {data, PyLong_FromSsize_t(pos), ext_type};
	PyObject *got = decode_at(NULL, args, 3);
	Py_ssize_t end = -1;

	Py_DECREF(args[1]);
	if (got == NULL) {
		if (!PyErr_ExceptionMatches(PyExc_ValueError)) {
			PyErr_Print();
			abort();  /* MemoryError aside, a refusal is a bare ValueError */
		}
		PyErr_Clear();
		return -1;
	}
	if (!PyTuple_CheckExact(got) || PyTuple_GET_SIZE(got) != 2)
		abort();
	end = PyLong_AsSsize_t(PyTuple_GET_ITEM(got, 1));
	if (end <= pos || end > size)
		abort();
	Py_DECREF(got);
	return end;
}

int
LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	/* a bytes object holds its own copy, with a NUL after it that ASan cannot see past:
	 * a memoryview over a malloc'd copy of exactly `size` bytes is read instead */
	char *copy = malloc(size ? size : 1);
	memcpy(copy, data, size);
	PyObject *view = PyMemoryView_FromMemory(copy, (Py_ssize_t)size, PyBUF_READ);
	Py_ssize_t end = decode_once(view, 0, (Py_ssize_t)size);
	if (end > 0 && end < (Py_ssize_t)size)
		decode_once(view, end, (Py_ssize_t)size);
	Py_DECREF(view);
	free(copy);
	return 0;
}
