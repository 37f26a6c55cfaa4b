/* pgoutput Insert, Update and Delete messages parsed in C: the per-column loop of their TupleData is the
 * hot path of the whole capture side.
 *
 * parse_change(data: bytes, in_stream: bool) returns the message object, or None when the bytes are
 * malformed in any way: the pure-Python parser then runs on the same bytes and raises the DecodeError that
 * names the message, the field and the offset. Every read is bounds-checked here as well.
 *
 * parse_raw(data, in_stream) checks the same and returns a RawChange (the message with its tuple data left as
 * bytes), or None. TupleStore holds a run of changes of one relation version as their tuple data's wire bytes,
 * and gather() turns a selection of them into one byte array per column (offsets, values, validity, kinds):
 * from the wire to columns with no Python object per value (tuple_store.py is the same in Python).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

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

/* -- raw changes ----------------------------------------------------------------------------------- */

static PyObject *raw_class, *raw_slots[4];  /* RawChange and its slots: op, xid, relation_id, data */
static PyObject *op_names[3];                /* "I", "U", "D" */

/* The end of the TupleData at pos (its column count first) when well formed, else -1; *count its columns. */
static Py_ssize_t
tuple_end(const unsigned char *data, Py_ssize_t end, Py_ssize_t pos, int *count_out)
{
    if (pos < 0 || pos + 2 > end)
        return -1;
    int16_t count = (int16_t) (((uint16_t) data[pos] << 8) | data[pos + 1]);
    pos += 2;
    if (count < 0 || count > end - pos)
        return -1;
    for (int index = 0; index < count; index++) {
        if (pos >= end)
            return -1;
        unsigned char kind = data[pos];
        if (kind == 't' || kind == 'b') {
            if (pos + 5 > end)
                return -1;
            int32_t size = (int32_t) read_u32(data + pos + 1);
            Py_ssize_t start = pos + 5;
            if (size < 0 || size > end - start)
                return -1;
            pos = start + size;
        } else if (kind == 'n' || kind == 'u') {
            pos += 1;
        } else {
            return -1;
        }
    }
    *count_out = count;
    return pos;
}

/* Where the tuples of an Insert/Update/Delete lie: 1 when well formed, 0 when not. new_at/old_at are the
 * offsets of the new and the old (or key) tuple's column count, -1 when absent; *marker is 'K', 'O' or 0. */
typedef struct {
    int which;  /* 0 Insert, 1 Update, 2 Delete */
    Py_ssize_t relation_at, new_at, old_at;
    int new_count, old_count;
    char marker;
} ChangeLayout;

static int
change_layout(const unsigned char *data, Py_ssize_t end, int in_stream, ChangeLayout *layout)
{
    Py_ssize_t pos = 1;
    if (end < 1)
        return 0;
    switch (data[0]) {
        case 'I': layout->which = 0; break;
        case 'U': layout->which = 1; break;
        case 'D': layout->which = 2; break;
        default: return 0;
    }
    if (in_stream)
        pos += 4;
    if (pos + 5 > end)
        return 0;
    layout->relation_at = pos;
    pos += 4;
    layout->new_at = layout->old_at = -1;
    layout->new_count = layout->old_count = 0;
    layout->marker = 0;
    unsigned char marker = data[pos++];
    if (layout->which != 0 && (marker == 'K' || marker == 'O')) {
        layout->marker = (char) marker;
        layout->old_at = pos;
        if ((pos = tuple_end(data, end, pos, &layout->old_count)) < 0)
            return 0;
        if (layout->which == 2)
            return pos == end;
        if (pos >= end)
            return 0;
        marker = data[pos++];
    } else if (layout->which == 2) {
        return 0;
    }
    if (marker != 'N')
        return 0;
    layout->new_at = pos;
    if ((pos = tuple_end(data, end, pos, &layout->new_count)) < 0)
        return 0;
    return pos == end;
}

/* parse_raw(data: bytes, in_stream) -> RawChange, or None when malformed (the Python decoder says where). */
static PyObject *
parse_raw(PyObject *self, PyObject *args)
{
    PyObject *data;
    int in_stream;
    if (raw_class == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "configure_raw() was not called");
        return NULL;
    }
    if (!PyArg_ParseTuple(args, "Sp", &data, &in_stream))
        return NULL;
    const unsigned char *bytes = (const unsigned char *) PyBytes_AS_STRING(data);
    ChangeLayout layout;
    if (!change_layout(bytes, PyBytes_GET_SIZE(data), in_stream, &layout))
        Py_RETURN_NONE;
    PyObject *xid = in_stream ? PyLong_FromUnsignedLong(read_u32(bytes + 1)) : Py_NewRef(Py_None);
    PyObject *relation_id = PyLong_FromUnsignedLong(read_u32(bytes + layout.relation_at));
    PyObject *message = ((PyTypeObject *) raw_class)->tp_alloc((PyTypeObject *) raw_class, 0);
    if (xid == NULL || relation_id == NULL || message == NULL) {
        Py_XDECREF(xid);
        Py_XDECREF(relation_id);
        Py_XDECREF(message);
        return NULL;
    }
    if (set_slot(raw_slots[0], message, Py_NewRef(op_names[layout.which])) < 0 ||
        set_slot(raw_slots[1], message, xid) < 0 || set_slot(raw_slots[2], message, relation_id) < 0 ||
        set_slot(raw_slots[3], message, Py_NewRef(data)) < 0) {
        Py_DECREF(message);
        return NULL;
    }
    return message;
}

/* configure_raw(RawChange, (op, xid, relation_id, data descriptors)) */
static PyObject *
configure_raw(PyObject *self, PyObject *args)
{
    PyObject *cls, *descriptors;
    if (!PyArg_ParseTuple(args, "OO!", &cls, &PyTuple_Type, &descriptors) || PyTuple_GET_SIZE(descriptors) != 4) {
        PyErr_SetString(PyExc_TypeError, "configure_raw: RawChange and its four slot descriptors");
        return NULL;
    }
    Py_XSETREF(raw_class, Py_NewRef(cls));
    for (int i = 0; i < 4; i++)
        Py_XSETREF(raw_slots[i], Py_NewRef(PyTuple_GET_ITEM(descriptors, i)));
    Py_RETURN_NONE;
}

/* -- TupleStore ------------------------------------------------------------------------------------ */

typedef struct {
    char *data;
    Py_ssize_t size, capacity;
} Buffer;

static int
buffer_append(Buffer *b, const void *src, Py_ssize_t size)
{
    if (b->size + size > b->capacity) {
        Py_ssize_t capacity = b->capacity ? b->capacity : 256;
        while (capacity < b->size + size)
            capacity *= 2;
        char *data = PyMem_Realloc(b->data, capacity);
        if (data == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        b->data = data;
        b->capacity = capacity;
    }
    memcpy(b->data + b->size, src, size);
    b->size += size;
    return 0;
}

/* A change: its op ('I', 'U', 'D', 'T'), what the old image came as ('K', 'O', 0), its ordinal and subtransaction
 * (-1: none) and its images (index into the store's images, -1: none). */
typedef struct {
    int64_t ordinal, subxid;
    int32_t new_image, old_image;
    char op, marker;
} StoredChange;

typedef struct {
    PyObject_HEAD
    Py_ssize_t width;
    Buffer data;      /* the images' TupleData bytes, each from its column count on, back to back */
    Buffer images;    /* int64: where each image starts in data */
    Buffer changes;   /* StoredChange */
    int unchanged_insert;  /* an insert whose new image left a value out as unchanged TOAST */
} TupleStore;

#define STORE_IMAGES(store) ((const int64_t *) (store)->images.data)
#define STORE_CHANGES(store) ((StoredChange *) (store)->changes.data)
#define STORE_COUNT(store) ((store)->changes.size / (Py_ssize_t) sizeof(StoredChange))
#define STORE_IMAGE_COUNT(store) ((store)->images.size / (Py_ssize_t) sizeof(int64_t))

static PyTypeObject TupleStoreType;

static int
store_init(TupleStore *self, PyObject *args, PyObject *kwargs)
{
    Py_ssize_t width;
    if (!PyArg_ParseTuple(args, "n", &width))
        return -1;
    if (width < 0 || width > 1664) {  /* MaxTupleAttributeNumber */
        PyErr_SetString(PyExc_ValueError, "width must be 0..1664");
        return -1;
    }
    self->width = width;
    return 0;
}

static void
store_dealloc(TupleStore *self)
{
    PyMem_Free(self->data.data);
    PyMem_Free(self->images.data);
    PyMem_Free(self->changes.data);
    Py_TYPE(self)->tp_free((PyObject *) self);
}

static int
width_error(TupleStore *self, int count)
{
    PyErr_Format(PyExc_ValueError, "a row has %d columns where the Relation message before it has %zd", count,
                 self->width);
    return -1;
}

/* Appends an image (well-formed TupleData bytes); its index, or -1 on error. */
static int32_t
store_image(TupleStore *self, const unsigned char *data, Py_ssize_t start, Py_ssize_t stop)
{
    int64_t at = self->data.size;
    Py_ssize_t index = STORE_IMAGE_COUNT(self);
    if (index >= INT32_MAX) {
        PyErr_SetString(PyExc_OverflowError, "too many row images in one run");
        return -1;
    }
    if (buffer_append(&self->images, &at, sizeof(at)) < 0 || buffer_append(&self->data, data + start, stop - start) < 0)
        return -1;
    return (int32_t) index;
}

static int
store_change(TupleStore *self, char op, char marker, int64_t ordinal, int64_t subxid, int32_t new_image,
             int32_t old_image)
{
    StoredChange change = {ordinal, subxid, new_image, old_image, op, marker};
    return buffer_append(&self->changes, &change, sizeof(change));
}

static int
has_unchanged(const unsigned char *data, Py_ssize_t start, Py_ssize_t stop)
{
    Py_ssize_t pos = start + 2;
    while (pos < stop) {
        unsigned char kind = data[pos];
        if (kind == 'u')
            return 1;
        pos += (kind == 't' || kind == 'b') ? 5 + (Py_ssize_t) read_u32(data + pos + 1) : 1;
    }
    return 0;
}

/* add_wire(data, in_stream, ordinal, subxid) -> True, or False when the bytes are malformed; ValueError when a
 * row's width is not the store's. */
static PyObject *
store_add_wire(TupleStore *self, PyObject *args)
{
    Py_buffer view;
    int in_stream;
    long long ordinal, subxid;
    if (!PyArg_ParseTuple(args, "y*pLL", &view, &in_stream, &ordinal, &subxid))
        return NULL;
    const unsigned char *data = view.buf;
    ChangeLayout layout;
    PyObject *result = NULL;
    if (!change_layout(data, view.len, in_stream, &layout)) {
        result = Py_NewRef(Py_False);
        goto done;
    }
    if ((layout.new_at >= 0 && layout.new_count != self->width) ||
        (layout.old_at >= 0 && layout.old_count != self->width)) {
        width_error(self, layout.new_at >= 0 && layout.new_count != self->width ? layout.new_count
                                                                                 : layout.old_count);
        goto done;
    }
    int32_t old_image = -1, new_image = -1;
    if (layout.old_at >= 0) {
        Py_ssize_t stop = layout.which == 2 ? view.len : layout.new_at - 1;
        if ((old_image = store_image(self, data, layout.old_at, stop)) < 0)
            goto done;
    }
    if (layout.new_at >= 0) {
        if ((new_image = store_image(self, data, layout.new_at, view.len)) < 0)
            goto done;
        if (layout.which == 0 && !self->unchanged_insert)
            self->unchanged_insert = has_unchanged(data, layout.new_at, view.len);
    }
    if (store_change(self, "IUD"[layout.which], layout.marker, ordinal, subxid, new_image, old_image) < 0)
        goto done;
    result = Py_NewRef(Py_True);
done:
    PyBuffer_Release(&view);
    return result;
}

/* A TupleData object's wire bytes appended as an image; its index, -1 on error. */
static int32_t
store_tuple_object(TupleStore *self, PyObject *tuple_data)
{
    PyObject *kinds = PyObject_GetAttrString(tuple_data, "kinds");
    PyObject *values = kinds ? PyObject_GetAttrString(tuple_data, "values") : NULL;
    PyObject *sequence = values ? PySequence_Fast(values, "TupleData values must be a sequence") : NULL;
    int32_t index = -1;
    Buffer wire = {NULL, 0, 0};
    if (sequence == NULL)
        goto done;
    if (!PyUnicode_Check(kinds) || PyUnicode_KIND(kinds) != PyUnicode_1BYTE_KIND ||
        PyUnicode_GET_LENGTH(kinds) != PySequence_Fast_GET_SIZE(sequence)) {
        PyErr_SetString(PyExc_ValueError, "TupleData kinds and values differ in length");
        goto done;
    }
    Py_ssize_t count = PyUnicode_GET_LENGTH(kinds);
    if (count != self->width) {
        width_error(self, (int) count);
        goto done;
    }
    const Py_UCS1 *chars = PyUnicode_1BYTE_DATA(kinds);
    unsigned char head[5] = {(unsigned char) (count >> 8), (unsigned char) count};
    if (buffer_append(&wire, head, 2) < 0)
        goto done;
    for (Py_ssize_t c = 0; c < count; c++) {
        unsigned char kind = chars[c];
        if (kind == 't' || kind == 'b') {
            Py_buffer value;
            if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(sequence, c), &value, PyBUF_SIMPLE) < 0)
                goto done;
            uint32_t size = (uint32_t) value.len;
            head[0] = kind;
            head[1] = (unsigned char) (size >> 24);
            head[2] = (unsigned char) (size >> 16);
            head[3] = (unsigned char) (size >> 8);
            head[4] = (unsigned char) size;
            int failed = buffer_append(&wire, head, 5) < 0 || buffer_append(&wire, value.buf, value.len) < 0;
            PyBuffer_Release(&value);
            if (failed)
                goto done;
        } else if (kind == 'n' || kind == 'u') {
            if (buffer_append(&wire, &kind, 1) < 0)
                goto done;
        } else {
            PyErr_Format(PyExc_ValueError, "unknown tuple column kind %c", kind);
            goto done;
        }
    }
    index = store_image(self, (const unsigned char *) wire.data, 0, wire.size);
done:
    PyMem_Free(wire.data);
    Py_XDECREF(kinds);
    Py_XDECREF(values);
    Py_XDECREF(sequence);
    return index;
}

/* add(op, new, old, key, ordinal, subxid): a change from message objects (TupleData or None each); op 'T' has
 * no images. */
static PyObject *
store_add(TupleStore *self, PyObject *args)
{
    int op;
    PyObject *new, *old, *key;
    long long ordinal, subxid;
    if (!PyArg_ParseTuple(args, "COOOLL", &op, &new, &old, &key, &ordinal, &subxid))
        return NULL;
    if (op != 'I' && op != 'U' && op != 'D' && op != 'T') {
        PyErr_Format(PyExc_ValueError, "op must be I, U, D or T, not %c", op);
        return NULL;
    }
    int32_t new_image = -1, old_image = -1;
    char marker = 0;
    PyObject *before = old != Py_None ? old : key;
    if (op != 'T' && before != Py_None) {
        marker = old != Py_None ? 'O' : 'K';
        if ((old_image = store_tuple_object(self, before)) < 0)
            return NULL;
    }
    if (op != 'T' && op != 'D' && new != Py_None) {
        if ((new_image = store_tuple_object(self, new)) < 0)
            return NULL;
        if (op == 'I' && !self->unchanged_insert) {
            const unsigned char *data = (const unsigned char *) self->data.data;
            self->unchanged_insert = has_unchanged(data, STORE_IMAGES(self)[new_image], self->data.size);
        }
    }
    if (store_change(self, (char) op, marker, ordinal, subxid, new_image, old_image) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static Py_ssize_t
store_length(TupleStore *self)
{
    return STORE_COUNT(self);
}

/* An image as a TupleData object. */
static PyObject *
image_object(TupleStore *self, int32_t image)
{
    if (image < 0)
        Py_RETURN_NONE;
    Py_ssize_t pos = (Py_ssize_t) STORE_IMAGES(self)[image];
    PyObject *result = NULL;
    int status = parse_tuple_at((const unsigned char *) self->data.data, self->data.size, &pos, &result);
    if (status == 0)
        PyErr_SetString(PyExc_RuntimeError, "a stored row image is malformed");
    return status > 0 ? result : NULL;
}

/* change(i) -> (op, ordinal, subxid or None, new, old, key): TupleData or None each. */
static PyObject *
store_change_at(TupleStore *self, PyObject *arg)
{
    Py_ssize_t index = PyLong_AsSsize_t(arg);
    if (index == -1 && PyErr_Occurred())
        return NULL;
    if (index < 0 || index >= STORE_COUNT(self)) {
        PyErr_SetString(PyExc_IndexError, "change index out of range");
        return NULL;
    }
    if (tuple_class == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "configure() was not called");
        return NULL;
    }
    const StoredChange *change = &STORE_CHANGES(self)[index];
    PyObject *new = image_object(self, change->new_image);
    PyObject *old = new ? image_object(self, change->old_image) : NULL;
    PyObject *subxid = change->subxid < 0 ? Py_NewRef(Py_None) : PyLong_FromLongLong(change->subxid);
    if (old == NULL || subxid == NULL) {
        Py_XDECREF(new);
        Py_XDECREF(old);
        Py_XDECREF(subxid);
        return NULL;
    }
    PyObject *key = Py_NewRef(Py_None);
    if (change->marker == 'K') {
        Py_SETREF(key, old);
        old = Py_NewRef(Py_None);
    }
    return Py_BuildValue("(CLNNNN)", change->op, (long long) change->ordinal, subxid, new, old, key);
}

/* The changes' ordinals or subtransactions (-1: none) as int64 bytes (native order), for NumPy. */
static PyObject *
store_int64s(TupleStore *self, int subxids)
{
    Py_ssize_t count = STORE_COUNT(self);
    PyObject *result = PyBytes_FromStringAndSize(NULL, count * 8);
    if (result == NULL)
        return NULL;
    int64_t *out = (int64_t *) PyBytes_AS_STRING(result);
    for (Py_ssize_t i = 0; i < count; i++)
        out[i] = subxids ? STORE_CHANGES(self)[i].subxid : STORE_CHANGES(self)[i].ordinal;
    return result;
}

static PyObject *
store_ordinals(TupleStore *self, PyObject *unused)
{
    return store_int64s(self, 0);
}

static PyObject *
store_subxids(TupleStore *self, PyObject *unused)
{
    return store_int64s(self, 1);
}

static PyObject *
store_get_nbytes(TupleStore *self, void *closure)
{
    return PyLong_FromSsize_t(self->data.size + self->images.size + self->changes.size);
}

static PyObject *
store_get_unchanged_insert(TupleStore *self, void *closure)
{
    return PyBool_FromLong(self->unchanged_insert);
}

static PyObject *
store_get_width(TupleStore *self, void *closure)
{
    return PyLong_FromSsize_t(self->width);
}

/* -- gather ---------------------------------------------------------------------------------------- */

/* One column of gathered images: its kinds, then Arrow's offsets (int32, or int64 past 2 GB), values, validity. */
typedef struct {
    Py_ssize_t bytes, nulls;
    int offset_width;
    PyObject *kinds, *offsets, *data, *validity;
    char *kinds_out, *offsets_out, *data_out;
    unsigned char *validity_out;
} GatheredColumn;

typedef struct {
    const unsigned char *at;  /* the value's bytes */
    int32_t size;
    unsigned char kind;
} Value;

/* The values of an image (width of them), or every one null for image -1. */
static void
image_values(const TupleStore *store, int32_t image, Value *values)
{
    Py_ssize_t width = store->width;
    if (image < 0) {
        for (Py_ssize_t c = 0; c < width; c++)
            values[c] = (Value) {NULL, 0, 'n'};
        return;
    }
    const unsigned char *p = (const unsigned char *) store->data.data + STORE_IMAGES(store)[image] + 2;
    for (Py_ssize_t c = 0; c < width; c++) {
        unsigned char kind = *p;
        if (kind == 't' || kind == 'b') {
            int32_t size = (int32_t) read_u32(p + 1);
            values[c] = (Value) {p + 5, size, kind};
            p += 5 + size;
        } else {
            values[c] = (Value) {NULL, 0, kind};
            p += 1;
        }
    }
}

typedef struct {
    TupleStore *store;
    Py_buffer selection;  /* int64 change indices, unless all */
    int all, opened;
    Py_ssize_t count;
} Piece;

static inline const StoredChange *
piece_change(const Piece *piece, Py_ssize_t i)
{
    Py_ssize_t index = piece->all ? i : (Py_ssize_t) ((const int64_t *) piece->selection.buf)[i];
    return &STORE_CHANGES(piece->store)[index];
}

/* The after image (the row after the change; the old one for a DELETE) and the before image of a change. */
static inline void
change_images(const StoredChange *change, int32_t *after, int32_t *before)
{
    *before = change->op == 'T' ? -1 : change->old_image;
    *after = change->op == 'T' ? -1 : change->op == 'D' ? change->old_image : change->new_image;
}

static void
measure(GatheredColumn *columns, const Value *values, Py_ssize_t width)
{
    for (Py_ssize_t c = 0; c < width; c++)
        if (values[c].kind == 't' || values[c].kind == 'b')
            columns[c].bytes += values[c].size;
        else
            columns[c].nulls++;
}

static void
fill(GatheredColumn *columns, const Value *values, Py_ssize_t width, Py_ssize_t row)
{
    for (Py_ssize_t c = 0; c < width; c++) {
        GatheredColumn *column = &columns[c];
        const Value *value = &values[c];
        column->kinds_out[row] = (char) value->kind;
        if (value->kind == 't' || value->kind == 'b') {
            memcpy(column->data_out + column->bytes, value->at, value->size);
            column->bytes += value->size;
            column->validity_out[row >> 3] |= (unsigned char) (1 << (row & 7));
        }
        if (column->offset_width == 4) {
            int32_t end = (int32_t) column->bytes;
            memcpy(column->offsets_out + 4 * (row + 1), &end, 4);
        } else {
            int64_t end = column->bytes;
            memcpy(column->offsets_out + 8 * (row + 1), &end, 8);
        }
    }
}

static int
allocate(GatheredColumn *columns, Py_ssize_t width, Py_ssize_t rows)
{
    for (Py_ssize_t c = 0; c < width; c++) {
        GatheredColumn *column = &columns[c];
        column->offset_width = column->bytes > INT32_MAX ? 8 : 4;
        column->kinds = PyBytes_FromStringAndSize(NULL, rows);
        column->offsets = PyBytes_FromStringAndSize(NULL, (rows + 1) * column->offset_width);
        column->data = PyBytes_FromStringAndSize(NULL, column->bytes);
        column->validity = PyBytes_FromStringAndSize(NULL, (rows + 7) / 8);
        if (!column->kinds || !column->offsets || !column->data || !column->validity)
            return -1;
        column->kinds_out = PyBytes_AS_STRING(column->kinds);
        column->offsets_out = PyBytes_AS_STRING(column->offsets);
        column->data_out = PyBytes_AS_STRING(column->data);
        column->validity_out = (unsigned char *) PyBytes_AS_STRING(column->validity);
        memset(column->validity_out, 0, (rows + 7) / 8);
        memset(column->offsets_out, 0, column->offset_width);
        column->bytes = 0;
    }
    return 0;
}

static PyObject *
columns_result(GatheredColumn *columns, Py_ssize_t width)
{
    PyObject *list = PyList_New(width);
    if (list == NULL)
        return NULL;
    for (Py_ssize_t c = 0; c < width; c++) {
        GatheredColumn *column = &columns[c];
        PyObject *item = Py_BuildValue("(OOiOOn)", column->kinds, column->offsets, column->offset_width,
                                       column->data, column->validity, column->nulls);
        if (item == NULL) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, c, item);
    }
    return list;
}

static void
columns_free(GatheredColumn *columns, Py_ssize_t width)
{
    for (Py_ssize_t c = 0; columns != NULL && c < width; c++) {
        Py_XDECREF(columns[c].kinds);
        Py_XDECREF(columns[c].offsets);
        Py_XDECREF(columns[c].data);
        Py_XDECREF(columns[c].validity);
    }
    PyMem_Free(columns);
}

static int
same_value(const Value *a, const Value *b)
{
    return a->kind == b->kind && a->size == b->size && (a->size == 0 || memcmp(a->at, b->at, a->size) == 0);
}

/* gather(pieces, width, key_index) -> (ops, has_before, key_changed, after, before)
 *
 * pieces: a sequence of (TupleStore, selection): selection None for every change of the store, else int64 change
 * indices (a buffer). ops: one byte per change; has_before, key_changed: one byte (0/1) per change; after, before:
 * per column (kinds, offsets, offset width, values, validity bitmap, null count). A change's after image is its new
 * row (the old one for a DELETE, none for a TRUNCATE); its before image the old row or key sent with it. A key
 * changed when an UPDATE's old image holds a key column value (not unchanged TOAST) other than its new one. */
static PyObject *
gather(PyObject *self, PyObject *args)
{
    PyObject *pieces_arg, *key_arg;
    Py_ssize_t width;
    if (!PyArg_ParseTuple(args, "OnO", &pieces_arg, &width, &key_arg))
        return NULL;
    if (width < 0 || width > 1664) {
        PyErr_SetString(PyExc_ValueError, "width must be 0..1664");
        return NULL;
    }
    PyObject *pieces_seq = PySequence_Fast(pieces_arg, "pieces must be a sequence");
    PyObject *keys_seq = pieces_seq ? PySequence_Fast(key_arg, "key_index must be a sequence") : NULL;
    if (keys_seq == NULL) {
        Py_XDECREF(pieces_seq);
        return NULL;
    }
    Py_ssize_t piece_count = PySequence_Fast_GET_SIZE(pieces_seq), key_count = PySequence_Fast_GET_SIZE(keys_seq);
    Piece *pieces = PyMem_Calloc(piece_count ? piece_count : 1, sizeof(Piece));
    Py_ssize_t *keys = PyMem_Calloc(key_count ? key_count : 1, sizeof(Py_ssize_t));
    GatheredColumn *after = PyMem_Calloc(width ? width : 1, sizeof(GatheredColumn));
    GatheredColumn *before = PyMem_Calloc(width ? width : 1, sizeof(GatheredColumn));
    Value *after_values = PyMem_Calloc(width ? width : 1, sizeof(Value));
    Value *before_values = PyMem_Calloc(width ? width : 1, sizeof(Value));
    PyObject *ops = NULL, *has_before = NULL, *key_changed = NULL, *result = NULL;
    Py_ssize_t rows = 0;
    if (!pieces || !keys || !after || !before || !after_values || !before_values) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t k = 0; k < key_count; k++) {
        keys[k] = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(keys_seq, k));
        if (keys[k] == -1 && PyErr_Occurred())
            goto done;
        if (keys[k] < 0 || keys[k] >= width) {
            PyErr_SetString(PyExc_ValueError, "key column index out of range");
            goto done;
        }
    }
    for (Py_ssize_t p = 0; p < piece_count; p++) {
        PyObject *store, *selection;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(pieces_seq, p), "O!O", &TupleStoreType, &store, &selection))
            goto done;
        Piece *piece = &pieces[p];
        piece->store = (TupleStore *) store;
        if (piece->store->width != width) {
            PyErr_SetString(PyExc_ValueError, "a store of another width");
            goto done;
        }
        if (selection == Py_None) {
            piece->all = 1;
            piece->count = STORE_COUNT(piece->store);
            continue;
        }
        if (PyObject_GetBuffer(selection, &piece->selection, PyBUF_SIMPLE) < 0)
            goto done;
        piece->opened = 1;
        piece->count = piece->selection.len / 8;
        for (Py_ssize_t i = 0; i < piece->count; i++) {
            int64_t index = ((const int64_t *) piece->selection.buf)[i];
            if (index < 0 || index >= STORE_COUNT(piece->store)) {
                PyErr_SetString(PyExc_IndexError, "selected change out of range");
                goto done;
            }
        }
    }
    for (Py_ssize_t p = 0; p < piece_count; p++) {
        for (Py_ssize_t i = 0; i < pieces[p].count; i++) {
            int32_t after_image, before_image;
            change_images(piece_change(&pieces[p], i), &after_image, &before_image);
            image_values(pieces[p].store, after_image, after_values);
            image_values(pieces[p].store, before_image, before_values);
            measure(after, after_values, width);
            measure(before, before_values, width);
            rows++;
        }
    }
    ops = PyBytes_FromStringAndSize(NULL, rows);
    has_before = PyBytes_FromStringAndSize(NULL, rows);
    key_changed = PyBytes_FromStringAndSize(NULL, rows);
    if (!ops || !has_before || !key_changed || allocate(after, width, rows) < 0 || allocate(before, width, rows) < 0)
        goto done;
    Py_ssize_t row = 0;
    for (Py_ssize_t p = 0; p < piece_count; p++) {
        for (Py_ssize_t i = 0; i < pieces[p].count; i++, row++) {
            const StoredChange *change = piece_change(&pieces[p], i);
            int32_t after_image, before_image;
            change_images(change, &after_image, &before_image);
            image_values(pieces[p].store, after_image, after_values);
            image_values(pieces[p].store, before_image, before_values);
            fill(after, after_values, width, row);
            fill(before, before_values, width, row);
            int old = before_image >= 0;
            char changed = 0;
            if (change->op == 'U' && old)
                for (Py_ssize_t k = 0; k < key_count && !changed; k++) {
                    const Value *was = &before_values[keys[k]];
                    changed = was->kind != 'u' && !same_value(was, &after_values[keys[k]]);
                }
            PyBytes_AS_STRING(ops)[row] = change->op;
            PyBytes_AS_STRING(has_before)[row] = (char) (old && (change->op == 'U' || change->op == 'D'));
            PyBytes_AS_STRING(key_changed)[row] = changed;
        }
    }
    PyObject *after_list = columns_result(after, width);
    PyObject *before_list = after_list ? columns_result(before, width) : NULL;
    if (before_list != NULL)
        result = Py_BuildValue("(OOONN)", ops, has_before, key_changed, after_list, before_list);
    else
        Py_XDECREF(after_list);
done:
    for (Py_ssize_t p = 0; pieces != NULL && p < piece_count; p++)
        if (pieces[p].opened)
            PyBuffer_Release(&pieces[p].selection);
    columns_free(after, width);
    columns_free(before, width);
    Py_XDECREF(ops);
    Py_XDECREF(has_before);
    Py_XDECREF(key_changed);
    PyMem_Free(pieces);
    PyMem_Free(keys);
    PyMem_Free(after_values);
    PyMem_Free(before_values);
    Py_DECREF(pieces_seq);
    Py_DECREF(keys_seq);
    return result;
}

static PyMethodDef store_methods[] = {
    {"add_wire", (PyCFunction) store_add_wire, METH_VARARGS,
     "add_wire(data, in_stream, ordinal, subxid): an Insert/Update/Delete's bytes; False when malformed"},
    {"add", (PyCFunction) store_add, METH_VARARGS,
     "add(op, new, old, key, ordinal, subxid): a change from TupleData objects (op 'T': none)"},
    {"change", (PyCFunction) store_change_at, METH_O, "change(i) -> (op, ordinal, subxid, new, old, key)"},
    {"ordinals", (PyCFunction) store_ordinals, METH_NOARGS, "the changes' ordinals, int64 bytes"},
    {"subxids", (PyCFunction) store_subxids, METH_NOARGS, "the changes' subtransactions (-1: none), int64 bytes"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef store_getset[] = {
    {"nbytes", (getter) store_get_nbytes, NULL, "bytes held", NULL},
    {"unchanged_insert", (getter) store_get_unchanged_insert, NULL,
     "whether an insert left a value out as unchanged TOAST", NULL},
    {"width", (getter) store_get_width, NULL, "columns of each row image", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PySequenceMethods store_sequence = {.sq_length = (lenfunc) store_length};

static PyTypeObject TupleStoreType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "pgcdc.pgoutput._tuple.TupleStore",
    .tp_doc = "TupleStore(width): a run of changes of one relation version, their row images as wire bytes",
    .tp_basicsize = sizeof(TupleStore),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc) store_init,
    .tp_dealloc = (destructor) store_dealloc,
    .tp_methods = store_methods,
    .tp_getset = store_getset,
    .tp_as_sequence = &store_sequence,
};

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
    {"parse_raw", parse_raw, METH_VARARGS, "An Insert, Update or Delete as a RawChange, or None if malformed."},
    {"configure_raw", configure_raw, METH_VARARGS, "Hand over RawChange and its slot descriptors."},
    {"gather", gather, METH_VARARGS,
     "gather(pieces, width, key_index) -> (ops, has_before, key_changed, after columns, before columns)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_tuple", NULL, -1, methods};

PyMODINIT_FUNC
PyInit__tuple(void)
{
    if (PyType_Ready(&TupleStoreType) < 0)
        return NULL;
    op_names[0] = PyUnicode_InternFromString("I");
    op_names[1] = PyUnicode_InternFromString("U");
    op_names[2] = PyUnicode_InternFromString("D");
    if (!op_names[0] || !op_names[1] || !op_names[2])
        return NULL;
    PyObject *module_object = PyModule_Create(&module);
    if (module_object == NULL)
        return NULL;
    if (PyModule_AddObjectRef(module_object, "TupleStore", (PyObject *) &TupleStoreType) < 0) {
        Py_DECREF(module_object);
        return NULL;
    }
    return module_object;
}
