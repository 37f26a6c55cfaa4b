/* 128-bit hashes of every value of an Arrow array, read in place from its buffers: the key index
 * (key_index.py) codes text, binary, decimal and composite keys by them, and a mirror's build hashes tens of
 * millions of keys, so the loop must not make a Python object per value.
 *
 *   hash_fixed(count, first, validity, data, width, h1, h2)
 *       values of `width` bytes each (integers normalized to int64, canonical float64, decimal128,
 *       fixed_size_binary): value i is data[(first + i) * width, +width)
 *   hash_binary(count, first, validity, offsets, offset_width, data, h1, h2)
 *       binary/string (offset_width 4) and large_binary/large_string (offset_width 8) values:
 *       value i is data[offsets[first + i], offsets[first + i + 1])
 *
 * `validity` is the array's validity bitmap (bit first + i) or None (no NULLs); h1 and h2 are writable
 * buffers of at least `count` uint64 each that receive the two halves of MurmurHash3_x64_128 (seed 0) of each
 * value, or of the NULL code (NULL_H1, NULL_H2) for a NULL. key_codes.py computes exactly the same numbers in
 * numpy when this module is not built.
 *
 * Every buffer length is checked against what the arguments ask for before the loop, and every offset is
 * checked against the data buffer inside it: odd input raises ValueError, it never reads out of bounds.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* The code of NULL (key_codes.NULL_CODE): a constant that a value hashes to with probability 2**-128. */
#define NULL_H1 0x9e3779b97f4a7c15ULL
#define NULL_H2 0xd1b54a32d192ed03ULL

static inline uint64_t
rotl64(uint64_t x, int r)
{
    return (x << r) | (x >> (64 - r));
}

static inline uint64_t
fmix64(uint64_t k)
{
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdULL;
    k ^= k >> 33;
    k *= 0xc4ceb9fe1a85ec53ULL;
    k ^= k >> 33;
    return k;
}

/* MurmurHash3_x64_128 (Austin Appleby, public domain), seed 0, little-endian block reads. */
static void
murmur3_128(const uint8_t *data, size_t length, uint64_t *out1, uint64_t *out2)
{
    const uint64_t c1 = 0x87c37b91114253d5ULL, c2 = 0x4cf5ad432745937fULL;
    const size_t blocks = length / 16;
    uint64_t h1 = 0, h2 = 0, k1, k2;
    for (size_t i = 0; i < blocks; i++) {
        memcpy(&k1, data + i * 16, 8);
        memcpy(&k2, data + i * 16 + 8, 8);
        k1 *= c1;
        k1 = rotl64(k1, 31);
        k1 *= c2;
        h1 ^= k1;
        h1 = rotl64(h1, 27);
        h1 += h2;
        h1 = h1 * 5 + 0x52dce729;
        k2 *= c2;
        k2 = rotl64(k2, 33);
        k2 *= c1;
        h2 ^= k2;
        h2 = rotl64(h2, 31);
        h2 += h1;
        h2 = h2 * 5 + 0x38495ab5;
    }
    /* the tail: up to 15 bytes, zero-padded, as two little-endian words */
    const uint8_t *tail = data + blocks * 16;
    const size_t rest = length & 15;
    uint8_t padded[16] = {0};
    memcpy(padded, tail, rest);
    memcpy(&k1, padded, 8);
    memcpy(&k2, padded + 8, 8);
    if (rest > 8) {
        k2 *= c2;
        k2 = rotl64(k2, 33);
        k2 *= c1;
        h2 ^= k2;
    }
    if (rest > 0) {
        k1 *= c1;
        k1 = rotl64(k1, 31);
        k1 *= c2;
        h1 ^= k1;
    }
    h1 ^= (uint64_t) length;
    h2 ^= (uint64_t) length;
    h1 += h2;
    h2 += h1;
    h1 = fmix64(h1);
    h2 = fmix64(h2);
    h1 += h2;
    h2 += h1;
    *out1 = h1;
    *out2 = h2;
}

static inline int
is_null(const Py_buffer *validity, Py_ssize_t bit)
{
    return validity->buf != NULL && !((((const uint8_t *) validity->buf)[bit >> 3] >> (bit & 7)) & 1);
}

static inline void
store(const Py_buffer *out, Py_ssize_t index, uint64_t value)
{
    memcpy((char *) out->buf + index * 8, &value, 8);
}

/* The buffers of one call, acquired together and released together. */
typedef struct {
    Py_buffer validity, offsets, data, h1, h2;
} Buffers;

static void
buffers_release(Buffers *b)
{
    Py_buffer *all[] = {&b->validity, &b->offsets, &b->data, &b->h1, &b->h2};
    for (size_t i = 0; i < sizeof(all) / sizeof(all[0]); i++)
        if (all[i]->obj != NULL)
            PyBuffer_Release(all[i]);
}

/* validity: None or a buffer of at least (first + count) bits; h1, h2: writable, count uint64 each. */
static int
acquire_common(Buffers *b, PyObject *validity, PyObject *h1, PyObject *h2, Py_ssize_t count, Py_ssize_t first)
{
    if (count < 0 || first < 0 || first > PY_SSIZE_T_MAX - count - 1 || count > PY_SSIZE_T_MAX / 8) {
        PyErr_SetString(PyExc_ValueError, "count and first must be non-negative and not overflow");
        return -1;
    }
    if (validity != Py_None) {
        if (PyObject_GetBuffer(validity, &b->validity, PyBUF_SIMPLE) < 0)
            return -1;
        if (b->validity.len < (first + count + 7) / 8) {
            PyErr_SetString(PyExc_ValueError, "the validity bitmap is shorter than first + count bits");
            return -1;
        }
    }
    if (PyObject_GetBuffer(h1, &b->h1, PyBUF_WRITABLE) < 0 || PyObject_GetBuffer(h2, &b->h2, PyBUF_WRITABLE) < 0)
        return -1;
    if (b->h1.len < count * 8 || b->h2.len < count * 8) {
        PyErr_SetString(PyExc_ValueError, "the output buffers hold fewer than count uint64");
        return -1;
    }
    return 0;
}

static PyObject *
hash_fixed(PyObject *self, PyObject *args)
{
    Py_ssize_t count, first, width;
    PyObject *validity, *data, *h1, *h2;
    Buffers b;
    memset(&b, 0, sizeof(b));
    if (!PyArg_ParseTuple(args, "nnOOnOO", &count, &first, &validity, &data, &width, &h1, &h2))
        return NULL;
    if (acquire_common(&b, validity, h1, h2, count, first) < 0)
        goto error;
    if (PyObject_GetBuffer(data, &b.data, PyBUF_SIMPLE) < 0)
        goto error;
    if (width <= 0 || width > (1 << 20) || first + count > PY_SSIZE_T_MAX / width ||
        b.data.len < (first + count) * width) {
        PyErr_SetString(PyExc_ValueError, "the data buffer is shorter than (first + count) * width bytes");
        goto error;
    }
    Py_BEGIN_ALLOW_THREADS
    const uint8_t *values = (const uint8_t *) b.data.buf;
    for (Py_ssize_t i = 0; i < count; i++) {
        uint64_t a = NULL_H1, c = NULL_H2;
        if (!is_null(&b.validity, first + i))
            murmur3_128(values + (first + i) * width, (size_t) width, &a, &c);
        store(&b.h1, i, a);
        store(&b.h2, i, c);
    }
    Py_END_ALLOW_THREADS
    buffers_release(&b);
    Py_RETURN_NONE;
error:
    buffers_release(&b);
    return NULL;
}

static inline int64_t
offset_at(const Py_buffer *offsets, int width, Py_ssize_t index)
{
    if (width == 4) {
        int32_t value;
        memcpy(&value, (const char *) offsets->buf + index * 4, 4);
        return value;
    }
    int64_t value;
    memcpy(&value, (const char *) offsets->buf + index * 8, 8);
    return value;
}

static PyObject *
hash_binary(PyObject *self, PyObject *args)
{
    Py_ssize_t count, first, bad_row = -1;
    int offset_width;
    PyObject *validity, *offsets, *data, *h1, *h2;
    Buffers b;
    memset(&b, 0, sizeof(b));
    if (!PyArg_ParseTuple(args, "nnOOiOOO", &count, &first, &validity, &offsets, &offset_width, &data, &h1, &h2))
        return NULL;
    if (acquire_common(&b, validity, h1, h2, count, first) < 0)
        goto error;
    if (PyObject_GetBuffer(offsets, &b.offsets, PyBUF_SIMPLE) < 0 || PyObject_GetBuffer(data, &b.data, PyBUF_SIMPLE) < 0)
        goto error;
    if (offset_width != 4 && offset_width != 8) {
        PyErr_SetString(PyExc_ValueError, "offset_width must be 4 or 8");
        goto error;
    }
    if (first + count + 1 > PY_SSIZE_T_MAX / offset_width || b.offsets.len < (first + count + 1) * offset_width) {
        PyErr_SetString(PyExc_ValueError, "the offsets buffer is shorter than first + count + 1 offsets");
        goto error;
    }
    Py_BEGIN_ALLOW_THREADS
    const uint8_t *values = (const uint8_t *) b.data.buf;
    const int64_t data_length = (int64_t) b.data.len;
    for (Py_ssize_t i = 0; i < count; i++) {
        uint64_t a = NULL_H1, c = NULL_H2;
        if (!is_null(&b.validity, first + i)) {
            int64_t start = offset_at(&b.offsets, offset_width, first + i);
            int64_t end = offset_at(&b.offsets, offset_width, first + i + 1);
            if (start < 0 || end < start || end > data_length) {
                bad_row = i;
                break;
            }
            murmur3_128(values + start, (size_t) (end - start), &a, &c);
        }
        store(&b.h1, i, a);
        store(&b.h2, i, c);
    }
    Py_END_ALLOW_THREADS
    if (bad_row >= 0) {
        PyErr_Format(PyExc_ValueError, "the offsets of value %zd lie outside the data buffer", bad_row);
        goto error;
    }
    buffers_release(&b);
    Py_RETURN_NONE;
error:
    buffers_release(&b);
    return NULL;
}

static PyMethodDef methods[] = {
    {"hash_fixed", hash_fixed, METH_VARARGS,
     "(count, first, validity, data, width, h1, h2): MurmurHash3_x64_128 of fixed-width values into h1, h2"},
    {"hash_binary", hash_binary, METH_VARARGS,
     "(count, first, validity, offsets, offset_width, data, h1, h2): MurmurHash3_x64_128 of binary values"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_keyhash", NULL, -1, methods};

PyMODINIT_FUNC
PyInit__keyhash(void)
{
    return PyModule_Create(&module);
}
