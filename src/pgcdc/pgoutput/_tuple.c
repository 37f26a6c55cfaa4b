/* pgoutput TupleData, parsed in C: the per-column loop is the hot path of the whole capture side.
 *
 * parse(data: bytes, pos: int) -> (kinds: str, values: tuple, end: int), or None when the bytes are
 * malformed in any way: the pure-Python parser then runs on the same bytes and raises the DecodeError
 * that names the message, the field and the offset. Every read is bounds-checked here as well.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

static PyObject *
parse(PyObject *self, PyObject *args)
{
    Py_buffer buffer;
    Py_ssize_t pos;
    if (!PyArg_ParseTuple(args, "y*n", &buffer, &pos))
        return NULL;
    const unsigned char *data = (const unsigned char *) buffer.buf;
    const Py_ssize_t end = buffer.len;
    PyObject *kinds = NULL, *values = NULL;

    if (pos < 0 || pos + 2 > end)
        goto malformed;
    int16_t count = (int16_t) (((uint16_t) data[pos] << 8) | data[pos + 1]);
    pos += 2;
    if (count < 0 || count > end - pos)  /* every column takes at least one byte */
        goto malformed;
    kinds = PyUnicode_New(count, 127);
    values = PyTuple_New(count);
    if (kinds == NULL || values == NULL)
        goto error;
    Py_UCS1 *kind_chars = PyUnicode_1BYTE_DATA(kinds);
    for (Py_ssize_t index = 0; index < count; index++) {
        if (pos >= end)
            goto malformed;
        unsigned char kind = data[pos];
        if (kind == 't' || kind == 'b') {
            if (pos + 5 > end)
                goto malformed;
            int32_t size = (int32_t) (((uint32_t) data[pos + 1] << 24) | ((uint32_t) data[pos + 2] << 16) |
                                      ((uint32_t) data[pos + 3] << 8) | (uint32_t) data[pos + 4]);
            Py_ssize_t start = pos + 5;
            if (size < 0 || size > end - start)
                goto malformed;
            PyObject *value = PyBytes_FromStringAndSize((const char *) data + start, size);
            if (value == NULL)
                goto error;
            PyTuple_SET_ITEM(values, index, value);
            pos = start + size;
        } else if (kind == 'n' || kind == 'u') {
            Py_INCREF(Py_None);
            PyTuple_SET_ITEM(values, index, Py_None);
            pos += 1;
        } else {
            goto malformed;
        }
        kind_chars[index] = kind;
    }
    PyBuffer_Release(&buffer);
    return Py_BuildValue("(NNn)", kinds, values, pos);

malformed:
    Py_XDECREF(kinds);
    Py_XDECREF(values);
    PyBuffer_Release(&buffer);
    Py_RETURN_NONE;
error:
    Py_XDECREF(kinds);
    Py_XDECREF(values);
    PyBuffer_Release(&buffer);
    return NULL;
}

static PyMethodDef methods[] = {
    {"parse", parse, METH_VARARGS, "Parse pgoutput TupleData at pos: (kinds, values, end), or None if malformed."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_tuple", NULL, -1, methods};

PyMODINIT_FUNC
PyInit__tuple(void)
{
    return PyModule_Create(&module);
}
