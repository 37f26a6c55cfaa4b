/* pgoutput Insert, Update and Delete messages parsed in C: the per-column loop of their TupleData is the
 * hot path of the whole capture side.
 *
 * parse_change(data: bytes, in_stream: bool) returns the message object, or None when the bytes are
 * malformed in any way: the pure-Python parser then runs on the same bytes and raises the DecodeError that
 * names the message, the field and the offset. Every read is bounds-checked here as well.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

/* Classes and slot descriptors handed over by decode.py (configure): the C parser builds the same
 * frozen dataclass objects the Python parser builds, filling their slots through the descriptors. */
static PyObject *tuple_class, *tuple_slots[2];
static PyObject *change_classes[3], *change_slots[3][5];  /* Insert, Update, Delete */
static int change_slot_count[3] = {3, 5, 4};

static int
set_slot(PyObject *descriptor, PyObject *object, PyObject *value)
{
    int result = Py_TYPE(descriptor)->tp_descr_set(descriptor, object, value);
    Py_DECREF(value);
    return result;
}

/* 1 on success (*out set, *pos advanced), 0 when malformed, -1 on a Python error. */
static int
parse_tuple_at(const unsigned char *data, Py_ssize_t end, Py_ssize_t *pos_io, PyObject **out)
{
    Py_ssize_t pos = *pos_io;
    PyObject *kinds = NULL, *values = NULL, *result = NULL;
    if (pos < 0 || pos + 2 > end)
        return 0;
    int16_t count = (int16_t) (((uint16_t) data[pos] << 8) | data[pos + 1]);
    pos += 2;
    if (count < 0 || count > end - pos)
        return 0;
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
    result = ((PyTypeObject *) tuple_class)->tp_alloc((PyTypeObject *) tuple_class, 0);
    if (result == NULL)
        goto error;
    if (set_slot(tuple_slots[0], result, kinds) < 0) {
        kinds = NULL;
        goto error;
    }
    kinds = NULL;
    if (set_slot(tuple_slots[1], result, values) < 0) {
        values = NULL;
        goto error;
    }
    *out = result;
    *pos_io = pos;
    return 1;
malformed:
    Py_XDECREF(kinds);
    Py_XDECREF(values);
    return 0;
error:
    Py_XDECREF(kinds);
    Py_XDECREF(values);
    Py_XDECREF(result);
    return -1;
}

static uint32_t
read_u32(const unsigned char *data)
{
    return ((uint32_t) data[0] << 24) | ((uint32_t) data[1] << 16) | ((uint32_t) data[2] << 8) | data[3];
}

/* parse_change(data, in_stream) -> Insert | Update | Delete, or None when malformed (the Python parser then
 * raises the precise DecodeError). */
static PyObject *
parse_change(PyObject *self, PyObject *args)
{
    Py_buffer buffer;
    int in_stream;
    if (tuple_class == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "configure() was not called");
        return NULL;
    }
    if (!PyArg_ParseTuple(args, "y*p", &buffer, &in_stream))
        return NULL;
    const unsigned char *data = (const unsigned char *) buffer.buf;
    const Py_ssize_t end = buffer.len;
    PyObject *parts[5] = {NULL, NULL, NULL, NULL, NULL};  /* xid, relation_id, then tuples in field order */
    PyObject *message = NULL;
    int which, status = 0;
    Py_ssize_t pos = 1;
    if (end < 1)
        goto malformed;
    switch (data[0]) {
        case 'I': which = 0; break;
        case 'U': which = 1; break;
        case 'D': which = 2; break;
        default: goto malformed;
    }
    if (in_stream) {
        if (pos + 4 > end)
            goto malformed;
        parts[0] = PyLong_FromUnsignedLong(read_u32(data + pos));
        if (parts[0] == NULL)
            goto error;
        pos += 4;
    } else {
        Py_INCREF(Py_None);
        parts[0] = Py_None;
    }
    if (pos + 5 > end)
        goto malformed;
    parts[1] = PyLong_FromUnsignedLong(read_u32(data + pos));
    if (parts[1] == NULL)
        goto error;
    pos += 4;
    unsigned char marker = data[pos++];
    PyObject *tuple = NULL;
    if (which == 0) {  /* Insert: N new */
        if (marker != 'N')
            goto malformed;
        if ((status = parse_tuple_at(data, end, &pos, &tuple)) <= 0)
            goto failed;
        parts[2] = tuple;
    } else if (which == 1) {  /* Update: [K key | O old] N new -> key, old, new */
        Py_INCREF(Py_None);
        parts[2] = Py_None;
        Py_INCREF(Py_None);
        parts[3] = Py_None;
        if (marker == 'K' || marker == 'O') {
            if ((status = parse_tuple_at(data, end, &pos, &tuple)) <= 0)
                goto failed;
            int slot = marker == 'K' ? 2 : 3;
            Py_DECREF(parts[slot]);
            parts[slot] = tuple;
            if (pos >= end)
                goto malformed;
            marker = data[pos++];
        }
        if (marker != 'N')
            goto malformed;
        if ((status = parse_tuple_at(data, end, &pos, &tuple)) <= 0)
            goto failed;
        parts[4] = tuple;
    } else {  /* Delete: K key | O old -> key, old */
        if (marker != 'K' && marker != 'O')
            goto malformed;
        if ((status = parse_tuple_at(data, end, &pos, &tuple)) <= 0)
            goto failed;
        Py_INCREF(Py_None);
        parts[2] = marker == 'K' ? tuple : Py_None;
        parts[3] = marker == 'K' ? Py_None : tuple;
    }
    if (pos != end)
        goto malformed;
    message = ((PyTypeObject *) change_classes[which])->tp_alloc((PyTypeObject *) change_classes[which], 0);
    if (message == NULL)
        goto error;
    for (int i = 0; i < change_slot_count[which]; i++) {
        PyObject *part = parts[i];
        parts[i] = NULL;
        if (set_slot(change_slots[which][i], message, part) < 0)
            goto error;
    }
    PyBuffer_Release(&buffer);
    return message;

failed:
    if (status < 0)
        goto error;
malformed:
    for (int i = 0; i < 5; i++)
        Py_XDECREF(parts[i]);
    PyBuffer_Release(&buffer);
    Py_RETURN_NONE;
error:
    for (int i = 0; i < 5; i++)
        Py_XDECREF(parts[i]);
    Py_XDECREF(message);
    PyBuffer_Release(&buffer);
    return NULL;
}

/* configure(TupleData, (kinds, values), ((Insert, descriptors...), (Update, ...), (Delete, ...))) */
static PyObject *
configure(PyObject *self, PyObject *args)
{
    PyObject *tuple_cls, *tuple_descriptors, *changes;
    if (!PyArg_ParseTuple(args, "OOO", &tuple_cls, &tuple_descriptors, &changes))
        return NULL;
    if (!PyTuple_Check(tuple_descriptors) || PyTuple_GET_SIZE(tuple_descriptors) != 2 || !PyTuple_Check(changes)
        || PyTuple_GET_SIZE(changes) != 3) {
        PyErr_SetString(PyExc_TypeError, "configure: unexpected arguments");
        return NULL;
    }
    Py_INCREF(tuple_cls);
    tuple_class = tuple_cls;
    for (int i = 0; i < 2; i++) {
        tuple_slots[i] = PyTuple_GET_ITEM(tuple_descriptors, i);
        Py_INCREF(tuple_slots[i]);
    }
    for (int c = 0; c < 3; c++) {
        PyObject *entry = PyTuple_GET_ITEM(changes, c);
        if (!PyTuple_Check(entry) || PyTuple_GET_SIZE(entry) != 1 + change_slot_count[c]) {
            PyErr_SetString(PyExc_TypeError, "configure: a change class needs its slot descriptors");
            return NULL;
        }
        change_classes[c] = PyTuple_GET_ITEM(entry, 0);
        Py_INCREF(change_classes[c]);
        for (int i = 0; i < change_slot_count[c]; i++) {
            change_slots[c][i] = PyTuple_GET_ITEM(entry, 1 + i);
            Py_INCREF(change_slots[c][i]);
        }
    }
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"parse_change", parse_change, METH_VARARGS, "Parse an Insert, Update or Delete, or None if malformed."},
    {"configure", configure, METH_VARARGS, "Hand over the message classes and their slot descriptors."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_tuple", NULL, -1, methods};

PyMODINIT_FUNC
PyInit__tuple(void)
{
    return PyModule_Create(&module);
}
