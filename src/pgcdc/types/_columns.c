/* Column conversions that Arrow has no kernel for, in C: one pass over a column's values, no Python object
 * per value. Each function returns Arrow-ready buffers (bytes objects) or None when any value is outside
 * its fast path (a special value, an unusual form, a malformed value): convert.py then runs its exact
 * Python path on the same values, which applies the documented policy or raises the precise error.
 *
 *   split_columns(rows, width)            -> (list of per-column value lists, list of per-column kind strings)
 *   int_array_text(values, bytes_per_int) -> (offsets, list_valid, items, item_valid) or None
 *   int_array_binary(values, bytes_per_int) -> same
 *   numeric_binary(values, scale)         -> (int128 little-endian data, valid) or None
 *   uuid_binary(values)                   -> (36-char text data, valid) or None
 *   jsonb_binary(values)                  -> (offsets, data, valid) or None
 *   fixed_text(values, kind)              -> (native data, valid) or None; kind 'h' int16, 'i' int32,
 *                                            'q' int64, 'T' timestamp (micros since 1970)
 *   copy_binary_columns(data, width)      -> (rows, [(offsets, offset width 4|8, data, validity bitmap, nulls)]);
 *                                            ValueError naming the row and byte on malformed input
 *
 * ``values`` is a list of bytes/str/None or an Arrow binary/string array's packed buffers (see Values).
 * offsets are int32 (n + 1), valid and item_valid one byte per value (1 = not null).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <structmember.h>

typedef __int128 int128;

/* A growable byte buffer that becomes a bytes object without a copy when possible. */
typedef struct {
    char *data;
    Py_ssize_t size, capacity;
} Buffer;

static int
buffer_reserve(Buffer *b, Py_ssize_t extra)
{
    if (b->size + extra <= b->capacity)
        return 0;
    Py_ssize_t capacity = b->capacity ? b->capacity : 256;
    while (capacity < b->size + extra)
        capacity *= 2;
    char *data = PyMem_Realloc(b->data, capacity);
    if (data == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    b->data = data;
    b->capacity = capacity;
    return 0;
}

static int
buffer_append(Buffer *b, const void *src, Py_ssize_t size)
{
    if (buffer_reserve(b, size) < 0)
        return -1;
    memcpy(b->data + b->size, src, size);
    b->size += size;
    return 0;
}

static PyObject *
buffer_finish(Buffer *b)
{
    PyObject *bytes = PyBytes_FromStringAndSize(b->data ? b->data : "", b->size);
    PyMem_Free(b->data);
    b->data = NULL;
    return bytes;
}

static void
buffer_free(Buffer *b)
{
    PyMem_Free(b->data);
    b->data = NULL;
}

/* The bytes of a value: bytes, bytearray-like buffers or str (the snapshot's CSV values). */
static int
value_bytes(PyObject *value, const char **data, Py_ssize_t *size)
{
    if (PyBytes_Check(value)) {
        *data = PyBytes_AS_STRING(value);
        *size = PyBytes_GET_SIZE(value);
        return 0;
    }
    if (PyUnicode_Check(value)) {
        *data = PyUnicode_AsUTF8AndSize(value, size);
        return *data == NULL ? -1 : 0;
    }
    PyErr_SetString(PyExc_TypeError, "column values must be bytes or str");
    return -1;
}

/* A column's values: a Python sequence of bytes/str/None (the stream), or the buffers of an Arrow binary or
 * string array, packed by convert.py as (count, first, validity or None, offsets, offset width 4 or 8, data)
 * (the snapshot's COPY output), read in place. */
typedef struct {
    PyObject *sequence;  /* NULL when packed */
    Py_ssize_t count, first;
    int offset_width, has_validity;
    Py_buffer validity, offsets, data;
} Values;

static int
values_open(PyObject *object, Values *v)
{
    memset(v, 0, sizeof(*v));
    if (PyTuple_Check(object) && PyTuple_GET_SIZE(object) == 6) {
        PyObject *validity;
        if (!PyArg_ParseTuple(object, "nnOy*iy*", &v->count, &v->first, &validity, &v->offsets, &v->offset_width,
                              &v->data))
            return -1;
        if (validity != Py_None) {
            if (PyObject_GetBuffer(validity, &v->validity, PyBUF_SIMPLE) < 0)
                goto error;
            v->has_validity = 1;
        }
        Py_ssize_t needed_bits = v->first + v->count;
        if ((v->offset_width != 4 && v->offset_width != 8) || v->count < 0 || v->first < 0 ||
            v->offsets.len < (needed_bits + 1) * v->offset_width ||
            (v->has_validity && v->validity.len * 8 < needed_bits)) {
            PyErr_SetString(PyExc_ValueError, "packed column buffers are too short");
            goto error;
        }
        return 0;
    error:
        PyBuffer_Release(&v->offsets);
        PyBuffer_Release(&v->data);
        if (v->has_validity)
            PyBuffer_Release(&v->validity);
        return -1;
    }
    v->sequence = PySequence_Fast(object, "values must be a sequence");
    if (v->sequence == NULL)
        return -1;
    v->count = PySequence_Fast_GET_SIZE(v->sequence);
    return 0;
}

static inline int64_t
packed_offset(const Values *v, Py_ssize_t index)
{
    if (v->offset_width == 4) {
        int32_t o;
        memcpy(&o, (const char *) v->offsets.buf + 4 * index, 4);
        return o;
    }
    int64_t o;
    memcpy(&o, (const char *) v->offsets.buf + 8 * index, 8);
    return o;
}

/* Value r: 1 present (its bytes in *data, *size), 0 null, 2 neither bytes nor str (the exact path takes it),
 * -1 error (exception set). */
static int
values_get(const Values *v, Py_ssize_t r, const char **data, Py_ssize_t *size)
{
    if (v->sequence != NULL) {
        PyObject *value = PySequence_Fast_GET_ITEM(v->sequence, r);
        if (value == Py_None)
            return 0;
        if (!PyBytes_Check(value) && !PyUnicode_Check(value))
            return 2;
        return value_bytes(value, data, size) < 0 ? -1 : 1;
    }
    Py_ssize_t index = v->first + r;
    if (v->has_validity && !((((const unsigned char *) v->validity.buf)[index >> 3] >> (index & 7)) & 1))
        return 0;
    int64_t start = packed_offset(v, index), end = packed_offset(v, index + 1);
    if (start < 0 || end < start || end > v->data.len) {
        PyErr_SetString(PyExc_ValueError, "packed column offsets out of bounds");
        return -1;
    }
    *data = (const char *) v->data.buf + start;
    *size = (Py_ssize_t) (end - start);
    return 1;
}

static void
values_close(Values *v)
{
    if (v->sequence != NULL) {
        Py_DECREF(v->sequence);
        v->sequence = NULL;
        return;
    }
    PyBuffer_Release(&v->offsets);
    PyBuffer_Release(&v->data);
    if (v->has_validity)
        PyBuffer_Release(&v->validity);
}

/* -- split_columns ------------------------------------------------------------------------------- */

static PyObject *kinds_name, *values_name;
/* TupleData's class and the byte offsets of its two slots (configure_rows): a row of exactly that class is
 * read in place, anything else through ordinary attribute access. */
static PyTypeObject *row_class;
static Py_ssize_t kinds_offset, values_offset;

static PyObject *
configure_rows(PyObject *self, PyObject *args)
{
    PyObject *cls, *kinds_descr, *values_descr;
    if (!PyArg_ParseTuple(args, "O!OO", &PyType_Type, &cls, &kinds_descr, &values_descr))
        return NULL;
    if (!PyObject_TypeCheck(kinds_descr, &PyMemberDescr_Type) ||
        !PyObject_TypeCheck(values_descr, &PyMemberDescr_Type)) {
        PyErr_SetString(PyExc_TypeError, "expected the slot descriptors of kinds and values");
        return NULL;
    }
    PyMemberDef *kinds_member = ((PyMemberDescrObject *) kinds_descr)->d_member;
    PyMemberDef *values_member = ((PyMemberDescrObject *) values_descr)->d_member;
    if (kinds_member->type != T_OBJECT_EX || values_member->type != T_OBJECT_EX) {
        PyErr_SetString(PyExc_TypeError, "kinds and values must be object slots");
        return NULL;
    }
    Py_INCREF(cls);
    Py_XDECREF((PyObject *) row_class);
    row_class = (PyTypeObject *) cls;
    kinds_offset = kinds_member->offset;
    values_offset = values_member->offset;
    Py_RETURN_NONE;
}

static inline PyObject *
row_slot(PyObject *row, Py_ssize_t offset, PyObject *name)
{
    if (Py_TYPE(row) == row_class) {
        PyObject *value = *(PyObject **) ((char *) row + offset);
        if (value != NULL) {
            Py_INCREF(value);
            return value;
        }
    }
    return PyObject_GetAttr(row, name);
}

static PyObject *
split_columns(PyObject *self, PyObject *args)
{
    PyObject *rows;
    Py_ssize_t width;
    if (!PyArg_ParseTuple(args, "On", &rows, &width))
        return NULL;
    PyObject *sequence = PySequence_Fast(rows, "rows must be a sequence");
    if (sequence == NULL)
        return NULL;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(sequence);
    PyObject *columns = PyList_New(width), *kinds = PyList_New(width);
    char *kind_chars = PyMem_Malloc(count * width + 1);
    if (columns == NULL || kinds == NULL || kind_chars == NULL)
        goto error;
    for (Py_ssize_t c = 0; c < width; c++) {
        PyObject *column = PyList_New(count);
        if (column == NULL)
            goto error;
        PyList_SET_ITEM(columns, c, column);
    }
    for (Py_ssize_t r = 0; r < count; r++) {
        PyObject *row = PySequence_Fast_GET_ITEM(sequence, r);
        PyObject *row_kinds = row_slot(row, kinds_offset, kinds_name);
        PyObject *row_values = row_kinds ? row_slot(row, values_offset, values_name) : NULL;
        if (row_values == NULL) {
            Py_XDECREF(row_kinds);
            goto error;
        }
        if (!PyUnicode_Check(row_kinds) || PyUnicode_KIND(row_kinds) != PyUnicode_1BYTE_KIND ||
            PyUnicode_GET_LENGTH(row_kinds) != width || !PyTuple_Check(row_values) ||
            PyTuple_GET_SIZE(row_values) != width) {
            Py_DECREF(row_kinds);
            Py_DECREF(row_values);
            PyErr_Format(PyExc_ValueError, "row %zd does not have %zd columns", r, width);
            goto error;
        }
        const Py_UCS1 *chars = PyUnicode_1BYTE_DATA(row_kinds);
        for (Py_ssize_t c = 0; c < width; c++) {
            PyObject *value = PyTuple_GET_ITEM(row_values, c);
            Py_INCREF(value);
            PyList_SET_ITEM(PyList_GET_ITEM(columns, c), r, value);
            kind_chars[c * count + r] = (char) chars[c];
        }
        Py_DECREF(row_kinds);
        Py_DECREF(row_values);
    }
    for (Py_ssize_t c = 0; c < width; c++) {
        PyObject *text = PyUnicode_DecodeASCII(kind_chars + c * count, count, NULL);
        if (text == NULL)
            goto error;
        PyList_SET_ITEM(kinds, c, text);
    }
    PyMem_Free(kind_chars);
    Py_DECREF(sequence);
    return Py_BuildValue("(NN)", columns, kinds);
error:
    PyMem_Free(kind_chars);
    Py_XDECREF(columns);
    Py_XDECREF(kinds);
    Py_DECREF(sequence);
    return NULL;
}

/* -- integer arrays ------------------------------------------------------------------------------ */

typedef struct {
    Buffer offsets, list_valid, items, item_valid;
    int32_t count;
    int width;
} ListBuilder;

static int
store_int(ListBuilder *lb, int64_t value)
{
    if (lb->width == 2 && (value < INT16_MIN || value > INT16_MAX))
        return 0;
    if (lb->width == 4 && (value < INT32_MIN || value > INT32_MAX))
        return 0;
    char one = 1;
    int16_t v16 = (int16_t) value;
    int32_t v32 = (int32_t) value;
    const void *src = lb->width == 2 ? (const void *) &v16 : lb->width == 4 ? (const void *) &v32 : &value;
    if (buffer_append(&lb->items, src, lb->width) < 0 || buffer_append(&lb->item_valid, &one, 1) < 0)
        return -1;
    lb->count++;
    return 1;
}

static int
store_null_item(ListBuilder *lb)
{
    char zero = 0;
    int64_t nothing = 0;
    if (buffer_append(&lb->items, &nothing, lb->width) < 0 || buffer_append(&lb->item_valid, &zero, 1) < 0)
        return -1;
    lb->count++;
    return 1;
}

static int
end_row(ListBuilder *lb, int valid)
{
    char flag = (char) valid;
    if (buffer_append(&lb->offsets, &lb->count, 4) < 0 || buffer_append(&lb->list_valid, &flag, 1) < 0)
        return -1;
    return 0;
}

/* 1 parsed, 0 not on the fast path, -1 Python error. */
static int
parse_int_array_text(ListBuilder *lb, const char *s, Py_ssize_t n)
{
    Py_ssize_t i = 0;
    if (n > 0 && s[0] == '[') {  /* explicit bounds, "[0:2]={...}": the elements are what counts */
        while (i < n && s[i] != '=')
            i++;
        i++;
    }
    if (i >= n || s[i] != '{')
        return 0;
    int depth = 0, expect_value = 1;
    for (; i < n; i++) {
        char ch = s[i];
        if (ch == '{') {
            if (!expect_value)
                return 0;
            depth++;
            expect_value = 1;
        } else if (ch == '}') {
            if (--depth < 0)
                return 0;
            expect_value = 0;
            if (depth == 0 && i != n - 1)
                return 0;  /* something after the outer braces */
        } else if (depth == 0) {
            return 0;
        } else if (ch == ',') {
            expect_value = 1;
        } else if (ch == 'N') {
            if (!expect_value || i + 4 > n || memcmp(s + i, "NULL", 4) != 0)
                return 0;
            if (store_null_item(lb) < 0)
                return -1;
            i += 3;
            expect_value = 0;
        } else if (ch == '-' || (ch >= '0' && ch <= '9')) {
            if (!expect_value)
                return 0;
            int negative = ch == '-';
            Py_ssize_t j = i + negative;
            if (j >= n || s[j] < '0' || s[j] > '9')
                return 0;
            uint64_t magnitude = 0;
            for (; j < n && s[j] >= '0' && s[j] <= '9'; j++) {
                if (magnitude > (UINT64_MAX - 9) / 10)
                    return 0;
                magnitude = magnitude * 10 + (uint64_t) (s[j] - '0');
            }
            if (magnitude > (uint64_t) INT64_MAX + (uint64_t) negative)
                return 0;
            int64_t value = negative ? (int64_t) (0 - magnitude) : (int64_t) magnitude;
            int stored = store_int(lb, value);
            if (stored <= 0)
                return stored;
            i = j - 1;
            expect_value = 0;
        } else {
            return 0;  /* spaces, quotes, anything unusual: the exact parser */
        }
    }
    return depth == 0 ? 1 : 0;
}

static inline uint32_t
be32(const unsigned char *p)
{
    return ((uint32_t) p[0] << 24) | ((uint32_t) p[1] << 16) | ((uint32_t) p[2] << 8) | p[3];
}

static int
parse_int_array_binary(ListBuilder *lb, const unsigned char *p, Py_ssize_t n)
{
    if (n < 12)
        return 0;
    int32_t ndim = (int32_t) be32(p);
    if (ndim < 0 || ndim > 6)
        return 0;
    Py_ssize_t pos = 12 + 8 * (Py_ssize_t) ndim;
    if (pos > n)
        return 0;
    int64_t total = ndim ? 1 : 0;
    for (int d = 0; d < ndim; d++) {
        int32_t extent = (int32_t) be32(p + 12 + 8 * d);
        if (extent < 0)
            return 0;
        total *= extent;
        if (total > n)
            return 0;
    }
    for (int64_t e = 0; e < total; e++) {
        if (pos + 4 > n)
            return 0;
        int32_t size = (int32_t) be32(p + pos);
        pos += 4;
        if (size == -1) {
            if (store_null_item(lb) < 0)
                return -1;
            continue;
        }
        if (size != lb->width || pos + size > n)
            return 0;
        int64_t value;
        if (size == 2)
            value = (int16_t) ((p[pos] << 8) | p[pos + 1]);
        else if (size == 4)
            value = (int32_t) be32(p + pos);
        else {
            uint64_t v = 0;
            for (int k = 0; k < 8; k++)
                v = (v << 8) | p[pos + k];
            value = (int64_t) v;
        }
        if (store_int(lb, value) < 0)
            return -1;
        pos += size;
    }
    return pos == n ? 1 : 0;
}

static PyObject *
int_array(PyObject *args, int binary)
{
    PyObject *values;
    int width;
    if (!PyArg_ParseTuple(args, "Oi", &values, &width))
        return NULL;
    if (width != 2 && width != 4 && width != 8) {
        PyErr_SetString(PyExc_ValueError, "bytes_per_int must be 2, 4 or 8");
        return NULL;
    }
    Values source;
    if (values_open(values, &source) < 0)
        return NULL;
    ListBuilder lb = {{0}, {0}, {0}, {0}, 0, width};
    Py_ssize_t count = source.count;
    int32_t zero = 0;
    if (buffer_append(&lb.offsets, &zero, 4) < 0)
        goto error;
    for (Py_ssize_t r = 0; r < count; r++) {
        const char *data;
        Py_ssize_t size;
        int got = values_get(&source, r, &data, &size);
        if (got < 0)
            goto error;
        if (got == 2)
            goto not_fast;
        if (got == 0) {
            if (end_row(&lb, 0) < 0)
                goto error;
            continue;
        }
        int parsed = binary ? parse_int_array_binary(&lb, (const unsigned char *) data, size)
                            : parse_int_array_text(&lb, data, size);
        if (parsed < 0)
            goto error;
        if (parsed == 0)
            goto not_fast;
        if (end_row(&lb, 1) < 0)
            goto error;
    }
    values_close(&source);
    PyObject *offsets = buffer_finish(&lb.offsets), *list_valid = buffer_finish(&lb.list_valid);
    PyObject *items = buffer_finish(&lb.items), *item_valid = buffer_finish(&lb.item_valid);
    if (!offsets || !list_valid || !items || !item_valid) {
        Py_XDECREF(offsets);
        Py_XDECREF(list_valid);
        Py_XDECREF(items);
        Py_XDECREF(item_valid);
        return NULL;
    }
    return Py_BuildValue("(NNNN)", offsets, list_valid, items, item_valid);
not_fast:
    buffer_free(&lb.offsets);
    buffer_free(&lb.list_valid);
    buffer_free(&lb.items);
    buffer_free(&lb.item_valid);
    values_close(&source);
    Py_RETURN_NONE;
error:
    buffer_free(&lb.offsets);
    buffer_free(&lb.list_valid);
    buffer_free(&lb.items);
    buffer_free(&lb.item_valid);
    values_close(&source);
    return NULL;
}

static PyObject *
int_array_text(PyObject *self, PyObject *args)
{
    return int_array(args, 0);
}

static PyObject *
int_array_binary(PyObject *self, PyObject *args)
{
    return int_array(args, 1);
}

/* -- fixed-width columns -------------------------------------------------------------------------- */

/* Writes one present value (its bytes) into its slot: 1 written, 0 not on the fast path. */
typedef int (*ValueWriter)(const char *data, Py_ssize_t size, char *slot, const void *context);

/* (data, valid) for a column of fixed-width results: nulls get slots filled with null_fill; None when a value
 * is neither bytes nor str or its writer declines it. */
static PyObject *
fixed_width_column(PyObject *values, Py_ssize_t width, char null_fill, ValueWriter write, const void *context)
{
    Values source;
    if (values_open(values, &source) < 0)
        return NULL;
    Py_ssize_t count = source.count;
    PyObject *data = PyBytes_FromStringAndSize(NULL, width * count);
    PyObject *valid = PyBytes_FromStringAndSize(NULL, count);
    if (data == NULL || valid == NULL)
        goto error;
    char *out = PyBytes_AS_STRING(data), *flags = PyBytes_AS_STRING(valid);
    for (Py_ssize_t r = 0; r < count; r++) {
        char *slot = out + width * r;
        const char *value;
        Py_ssize_t size;
        int got = values_get(&source, r, &value, &size);
        if (got < 0)
            goto error;
        if (got == 0) {
            flags[r] = 0;
            memset(slot, null_fill, width);
            continue;
        }
        if (got == 2 || !write(value, size, slot, context)) {
            Py_DECREF(data);
            Py_DECREF(valid);
            values_close(&source);
            Py_RETURN_NONE;
        }
        flags[r] = 1;
    }
    values_close(&source);
    return Py_BuildValue("(NN)", data, valid);
error:
    Py_XDECREF(data);
    Py_XDECREF(valid);
    values_close(&source);
    return NULL;
}

/* -- numeric(p, s) binary ------------------------------------------------------------------------ */

static int128 POW10[39];

static int128 pow10_128(int e) { return POW10[e]; }

static void
init_pow10(void)
{
    POW10[0] = 1;
    for (int e = 1; e < 39; e++)
        POW10[e] = POW10[e - 1] * 10;
}

/* 1 with *out the value scaled by 10^scale, 0 when not exactly representable in 38 digits or special. */
static int
numeric_to_scaled(const unsigned char *p, Py_ssize_t n, int scale, int128 *out)
{
    if (n < 8)
        return 0;
    /* unsigned: numeric_send writes it as int16, yet a numeric holds up to 36,864 base-10000 digits */
    uint16_t ndigits = (uint16_t) ((p[0] << 8) | p[1]);
    int16_t weight = (int16_t) ((p[2] << 8) | p[3]);
    uint16_t sign = (uint16_t) ((p[4] << 8) | p[5]);
    if ((sign != 0x0000 && sign != 0x4000) || n != 8 + 2 * (Py_ssize_t) ndigits)
        return 0;  /* NaN, infinities, malformed: the exact path applies the policy */
    const int128 limit = POW10[38];
    int128 acc = 0;
    for (int i = 0; i < ndigits; i++) {
        uint16_t digit = (uint16_t) ((p[8 + 2 * i] << 8) | p[9 + 2 * i]);
        if (digit > 9999 || acc > limit / 10000)
            return 0;
        acc = acc * 10000 + digit;
    }
    /* acc holds the digits; the last one is worth 10000^(weight - ndigits + 1) */
    int exponent = 4 * ((int) weight - (int) ndigits + 1) + scale;
    if (acc == 0)
        exponent = 0;
    if (exponent > 0) {
        if (exponent > 38 || acc > limit / pow10_128(exponent))
            return 0;
        acc *= pow10_128(exponent);
    } else if (exponent < 0) {
        if (exponent < -38) {
            return 0;
        }
        int128 divisor = pow10_128(-exponent);
        if (acc % divisor != 0)
            return 0;  /* more decimal places than the scale: would round */
        acc /= divisor;
    }
    if (acc >= limit)
        return 0;
    *out = sign == 0x4000 ? -acc : acc;
    return 1;
}

static int
write_numeric(const char *data, Py_ssize_t size, char *slot, const void *context)
{
    int128 scaled;
    if (!numeric_to_scaled((const unsigned char *) data, size, *(const int *) context, &scaled))
        return 0;
    memcpy(slot, &scaled, 16);  /* Arrow's decimal128 is a little-endian two's complement int128 */
    return 1;
}

static PyObject *
numeric_binary(PyObject *self, PyObject *args)
{
    PyObject *values;
    int scale;
    if (!PyArg_ParseTuple(args, "Oi", &values, &scale))
        return NULL;
    if (scale < 0 || scale > 38) {
        PyErr_SetString(PyExc_ValueError, "scale must be 0..38");
        return NULL;
    }
    return fixed_width_column(values, 16, 0, write_numeric, &scale);
}

/* -- uuid binary -> canonical text ---------------------------------------------------------------- */

static int
write_uuid(const char *data, Py_ssize_t size, char *text, const void *context)
{
    static const char hex[] = "0123456789abcdef";
    if (size != 16)
        return 0;
    const unsigned char *u = (const unsigned char *) data;
    for (int i = 0, o = 0; i < 16; i++) {
        if (i == 4 || i == 6 || i == 8 || i == 10)
            text[o++] = '-';
        text[o++] = hex[u[i] >> 4];
        text[o++] = hex[u[i] & 15];
    }
    return 1;
}

static PyObject *
uuid_binary(PyObject *self, PyObject *args)
{
    PyObject *values;
    if (!PyArg_ParseTuple(args, "O", &values))
        return NULL;
    return fixed_width_column(values, 36, '0', write_uuid, NULL);
}

/* -- jsonb binary: version byte 1, then the JSON text ---------------------------------------------- */

static PyObject *
jsonb_binary(PyObject *self, PyObject *args)
{
    PyObject *values;
    if (!PyArg_ParseTuple(args, "O", &values))
        return NULL;
    Values source;
    if (values_open(values, &source) < 0)
        return NULL;
    Py_ssize_t count = source.count;
    Buffer offsets = {0}, text = {0};
    PyObject *valid = PyBytes_FromStringAndSize(NULL, count);
    int32_t offset = 0;
    if (valid == NULL || buffer_append(&offsets, &offset, 4) < 0)
        goto error;
    char *flags = PyBytes_AS_STRING(valid);
    for (Py_ssize_t r = 0; r < count; r++) {
        const char *value;
        Py_ssize_t size;
        int got = values_get(&source, r, &value, &size);
        if (got < 0)
            goto error;
        if (got == 0) {
            flags[r] = 0;
        } else {
            if (got == 2 || size < 1 || value[0] != 1 || (int64_t) offset + size - 1 > INT32_MAX)
                goto not_fast;
            if (buffer_append(&text, value + 1, size - 1) < 0)
                goto error;
            offset += (int32_t) (size - 1);
            flags[r] = 1;
        }
        if (buffer_append(&offsets, &offset, 4) < 0)
            goto error;
    }
    values_close(&source);
    PyObject *offsets_bytes = buffer_finish(&offsets), *text_bytes = buffer_finish(&text);
    if (offsets_bytes == NULL || text_bytes == NULL) {
        Py_XDECREF(offsets_bytes);
        Py_XDECREF(text_bytes);
        Py_DECREF(valid);
        return NULL;
    }
    return Py_BuildValue("(NNN)", offsets_bytes, text_bytes, valid);
not_fast:
    buffer_free(&offsets);
    buffer_free(&text);
    Py_DECREF(valid);
    values_close(&source);
    Py_RETURN_NONE;
error:
    buffer_free(&offsets);
    buffer_free(&text);
    Py_XDECREF(valid);
    values_close(&source);
    return NULL;
}

/* -- fixed-width values from their text form ------------------------------------------------------ */

static int
parse_digits(const char *s, Py_ssize_t n, Py_ssize_t *pos, int min_digits, int max_digits, int64_t *out)
{
    Py_ssize_t i = *pos;
    int64_t value = 0;
    int digits = 0;
    while (i < n && s[i] >= '0' && s[i] <= '9' && digits < max_digits) {
        value = value * 10 + (s[i] - '0');
        i++;
        digits++;
    }
    if (digits < min_digits)
        return 0;
    *pos = i;
    *out = value;
    return 1;
}

static int64_t
days_from_civil(int64_t y, int64_t m, int64_t d)
{
    y -= m <= 2;
    int64_t era = (y >= 0 ? y : y - 399) / 400;
    int64_t yoe = y - era * 400;
    int64_t doy = (153 * (m + (m > 2 ? -3 : 9)) + 2) / 5 + d - 1;
    int64_t doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    return era * 146097 + doe - 719468;
}

static int
valid_date(int64_t y, int64_t m, int64_t d)
{
    static const int days[] = {31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31};
    if (m < 1 || m > 12 || d < 1)
        return 0;
    int leap = (y % 4 == 0 && y % 100 != 0) || y % 400 == 0;
    return d <= days[m - 1] + (m == 2 && leap);
}

/* "YYYY-MM-DD" (years 0000-9999, AD): 1 with the days since 1970-01-01; BC, infinity, anything else: 0 */
static int
parse_date(const char *s, Py_ssize_t n, Py_ssize_t *pos, int64_t *days)
{
    int64_t y, m, d;
    Py_ssize_t i = *pos;
    if (!parse_digits(s, n, &i, 4, 4, &y) || i >= n || s[i++] != '-' || !parse_digits(s, n, &i, 2, 2, &m) ||
        i >= n || s[i++] != '-' || !parse_digits(s, n, &i, 2, 2, &d) || !valid_date(y, m, d))
        return 0;
    *pos = i;
    *days = days_from_civil(y, m, d);
    return 1;
}

static int
parse_timestamp(const char *s, Py_ssize_t n, int64_t *micros)
{
    Py_ssize_t i = 0;
    int64_t days, hh, mm, ss, fraction = 0;
    if (!parse_date(s, n, &i, &days) || i >= n || s[i++] != ' ' || !parse_digits(s, n, &i, 2, 2, &hh) ||
        i >= n || s[i++] != ':' || !parse_digits(s, n, &i, 2, 2, &mm) || i >= n || s[i++] != ':' ||
        !parse_digits(s, n, &i, 2, 2, &ss) || hh > 24 || mm > 59 || ss > 60)
        return 0;
    if (i < n && s[i] == '.') {
        i++;
        int digits = 0;
        while (i < n && s[i] >= '0' && s[i] <= '9' && digits < 6) {
            fraction = fraction * 10 + (s[i++] - '0');
            digits++;
        }
        if (digits == 0 || (i < n && s[i] >= '0' && s[i] <= '9'))
            return 0;
        for (; digits < 6; digits++)
            fraction *= 10;
    }
    int64_t offset = 0;
    if (i < n && (s[i] == '+' || s[i] == '-')) {
        int sign = s[i++] == '-' ? -1 : 1;
        int64_t oh, om = 0, os = 0;
        if (!parse_digits(s, n, &i, 2, 2, &oh))
            return 0;
        if (i < n && s[i] == ':') {
            i++;
            if (!parse_digits(s, n, &i, 2, 2, &om))
                return 0;
            if (i < n && s[i] == ':') {
                i++;
                if (!parse_digits(s, n, &i, 2, 2, &os))
                    return 0;
            }
        }
        offset = sign * (oh * 3600 + om * 60 + os);
    }
    if (i != n)
        return 0;  /* " BC", anything else: the exact path */
    *micros = (days * 86400 + hh * 3600 + mm * 60 + ss - offset) * 1000000 + fraction;
    return 1;
}

static int
parse_integer(const char *s, Py_ssize_t n, int64_t low, int64_t high, int64_t *out)
{
    Py_ssize_t i = 0;
    int negative = n > 0 && s[0] == '-';
    i += negative;
    if (i >= n || n - i > 19)
        return 0;
    uint64_t magnitude = 0;
    for (; i < n; i++) {
        if (s[i] < '0' || s[i] > '9')
            return 0;
        magnitude = magnitude * 10 + (uint64_t) (s[i] - '0');
    }
    if (magnitude > (uint64_t) INT64_MAX + (uint64_t) negative)
        return 0;
    int64_t value = negative ? (int64_t) (0 - magnitude) : (int64_t) magnitude;
    if (value < low || value > high)
        return 0;
    *out = value;
    return 1;
}

static int
write_integer_text(const char *s, Py_ssize_t n, char *slot, const void *context)
{
    int kind = *(const int *) context;
    int64_t low = kind == 'h' ? INT16_MIN : kind == 'i' ? INT32_MIN : INT64_MIN;
    int64_t high = kind == 'h' ? INT16_MAX : kind == 'i' ? INT32_MAX : INT64_MAX;
    int64_t integer;
    if (!parse_integer(s, n, low, high, &integer))
        return 0;
    if (kind == 'h') {
        int16_t v = (int16_t) integer;
        memcpy(slot, &v, 2);
    } else if (kind == 'i') {
        int32_t v = (int32_t) integer;
        memcpy(slot, &v, 4);
    } else {
        memcpy(slot, &integer, 8);
    }
    return 1;
}

static int
write_timestamp_text(const char *s, Py_ssize_t n, char *slot, const void *context)
{
    int64_t micros;
    if (!parse_timestamp(s, n, &micros))
        return 0;
    memcpy(slot, &micros, 8);
    return 1;
}

static PyObject *
fixed_text(PyObject *self, PyObject *args)
{
    PyObject *values;
    int kind;
    if (!PyArg_ParseTuple(args, "OC", &values, &kind))
        return NULL;
    int width = kind == 'h' ? 2 : kind == 'i' ? 4 : kind == 'q' || kind == 'T' ? 8 : 0;
    if (width == 0) {
        PyErr_SetString(PyExc_ValueError, "kind must be one of h, i, q, T");
        return NULL;
    }
    return fixed_width_column(values, width, 0, kind == 'T' ? write_timestamp_text : write_integer_text, &kind);
}

/* -- COPY ... TO STDOUT (FORMAT binary) -> one Arrow binary column per field --------------------------- */

static const char COPY_SIGNATURE[11] = {'P', 'G', 'C', 'O', 'P', 'Y', '\n', '\377', '\r', '\n', '\0'};

typedef struct {
    Py_ssize_t bytes, nulls;
    PyObject *offsets, *data, *validity;
    char *offsets_out, *data_out;
    unsigned char *validity_out;
    int offset_width;
} CopyColumn;

static PyObject *
copy_error(const char *message, Py_ssize_t row, Py_ssize_t position)
{
    PyErr_Format(PyExc_ValueError, "COPY binary data: %s (row %zd, byte %zd)", message, row, position);
    return NULL;
}

/* The first pass: checks the whole stream, counts rows and each column's bytes and nulls. -1 on malformed. */
static int
copy_binary_measure(const unsigned char *p, Py_ssize_t n, int width, Py_ssize_t *start, Py_ssize_t *rows_out,
                    CopyColumn *columns)
{
    if (n < 19 || memcmp(p, COPY_SIGNATURE, 11) != 0) {
        copy_error("no PGCOPY signature", 0, 0);
        return -1;
    }
    if (be32(p + 11) & 0xFFFF0000u) {  /* critical flags, e.g. OIDs included */
        copy_error("unsupported header flags", 0, 11);
        return -1;
    }
    uint32_t extension = be32(p + 15);
    if ((Py_ssize_t) extension > n - 19) {
        copy_error("header extension past the end", 0, 15);
        return -1;
    }
    Py_ssize_t pos = 19 + (Py_ssize_t) extension, rows = 0;
    *start = pos;
    for (;;) {
        if (pos + 2 > n) {
            copy_error("no trailer", rows, pos);
            return -1;
        }
        int16_t fields = (int16_t) ((p[pos] << 8) | p[pos + 1]);
        pos += 2;
        if (fields == -1) {
            if (pos != n) {
                copy_error("data after the trailer", rows, pos);
                return -1;
            }
            *rows_out = rows;
            return 0;
        }
        if (fields != width) {
            PyErr_Format(PyExc_ValueError, "COPY binary data: row %zd has %d fields, %d expected", rows,
                         (int) fields, width);
            return -1;
        }
        for (int c = 0; c < width; c++) {
            if (pos + 4 > n) {
                copy_error("row truncated", rows, pos);
                return -1;
            }
            int32_t size = (int32_t) be32(p + pos);
            pos += 4;
            if (size == -1) {
                columns[c].nulls++;
            } else if (size < 0 || size > n - pos) {
                copy_error(size < 0 ? "negative field length" : "field past the end", rows, pos - 4);
                return -1;
            } else {
                columns[c].bytes += size;
                pos += size;
            }
        }
        rows++;
    }
}

static PyObject *
copy_binary_columns(PyObject *self, PyObject *args)
{
    Py_buffer view;
    int width;
    if (!PyArg_ParseTuple(args, "y*i", &view, &width))
        return NULL;
    if (width < 0 || width > 1664) {  /* MaxTupleAttributeNumber */
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "width must be 0..1664");
        return NULL;
    }
    const unsigned char *p = view.buf;
    PyObject *result = NULL, *list = NULL;
    Py_ssize_t rows = 0, pos = 0;
    CopyColumn *columns = PyMem_Calloc(width ? width : 1, sizeof(CopyColumn));
    if (columns == NULL) {
        PyBuffer_Release(&view);
        return PyErr_NoMemory();
    }
    if (copy_binary_measure(p, view.len, width, &pos, &rows, columns) < 0)
        goto done;
    /* exact sizes known: each column's buffers are allocated once, as the bytes objects returned */
    for (int c = 0; c < width; c++) {
        CopyColumn *column = &columns[c];
        column->offset_width = column->bytes > INT32_MAX ? 8 : 4;
        column->offsets = PyBytes_FromStringAndSize(NULL, (rows + 1) * column->offset_width);
        column->data = PyBytes_FromStringAndSize(NULL, column->bytes);
        column->validity = PyBytes_FromStringAndSize(NULL, (rows + 7) / 8);
        if (!column->offsets || !column->data || !column->validity)
            goto done;
        column->offsets_out = PyBytes_AS_STRING(column->offsets);
        column->data_out = PyBytes_AS_STRING(column->data);
        column->validity_out = (unsigned char *) PyBytes_AS_STRING(column->validity);
        memset(column->validity_out, 0, (rows + 7) / 8);
        memset(column->offsets_out, 0, column->offset_width);
        column->bytes = 0;
    }
    /* the second pass: the stream is known to be well formed */
    for (Py_ssize_t r = 0; r < rows; r++) {
        pos += 2;
        for (int c = 0; c < width; c++) {
            CopyColumn *column = &columns[c];
            int32_t size = (int32_t) be32(p + pos);
            pos += 4;
            if (size >= 0) {
                memcpy(column->data_out + column->bytes, p + pos, size);
                column->bytes += size;
                pos += size;
                column->validity_out[r >> 3] |= (unsigned char) (1 << (r & 7));
            }
            if (column->offset_width == 4) {
                int32_t end = (int32_t) column->bytes;
                memcpy(column->offsets_out + 4 * (r + 1), &end, 4);
            } else {
                int64_t end = column->bytes;
                memcpy(column->offsets_out + 8 * (r + 1), &end, 8);
            }
        }
    }
    list = PyList_New(width);
    if (list == NULL)
        goto done;
    for (int c = 0; c < width; c++) {
        CopyColumn *column = &columns[c];
        PyObject *item = Py_BuildValue("(OiOOn)", column->offsets, column->offset_width, column->data,
                                       column->validity, column->nulls);
        if (item == NULL)
            goto done;
        PyList_SET_ITEM(list, c, item);
    }
    result = Py_BuildValue("(nO)", rows, list);
done:
    Py_XDECREF(list);
    for (int c = 0; c < width; c++) {
        Py_XDECREF(columns[c].offsets);
        Py_XDECREF(columns[c].data);
        Py_XDECREF(columns[c].validity);
    }
    PyMem_Free(columns);
    PyBuffer_Release(&view);
    return result;
}

static PyMethodDef methods[] = {
    {"fixed_text", fixed_text, METH_VARARGS, "integers and timestamps from text -> buffers, or None"},
    {"configure_rows", configure_rows, METH_VARARGS, "TupleData and its slot descriptors (kinds, values)"},
    {"split_columns", split_columns, METH_VARARGS, "rows of TupleData -> (per-column values, per-column kinds)"},
    {"int_array_text", int_array_text, METH_VARARGS, "integer arrays, text form -> list buffers, or None"},
    {"int_array_binary", int_array_binary, METH_VARARGS, "integer arrays, binary form -> list buffers, or None"},
    {"numeric_binary", numeric_binary, METH_VARARGS, "numeric binary -> decimal128 buffers at a scale, or None"},
    {"uuid_binary", uuid_binary, METH_VARARGS, "uuid binary -> 36-character text buffers, or None"},
    {"jsonb_binary", jsonb_binary, METH_VARARGS, "jsonb binary -> string buffers, or None"},
    {"copy_binary_columns", copy_binary_columns, METH_VARARGS,
     "COPY binary output, width -> (rows, per column (offsets, offset width, data, validity, null count))"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_columns", NULL, -1, methods};

PyMODINIT_FUNC
PyInit__columns(void)
{
    init_pow10();
    kinds_name = PyUnicode_InternFromString("kinds");
    values_name = PyUnicode_InternFromString("values");
    if (kinds_name == NULL || values_name == NULL)
        return NULL;
    return PyModule_Create(&module);
}
