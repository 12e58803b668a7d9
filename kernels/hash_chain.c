/* The block-hash chain in one C loop: kvtierd/block_hash.py's encoding, hashed without a Python
 * step per block (kvtierd/hash_chain_native.py loads it; it is optional: without a C compiler at
 * install time the Python loop runs, with the same result).
 *
 * Block i's message is `head + tokens[i] + tail + parent`, where parent is the digest of block
 * i - 1 (the given parent for block 0), and its digest is the hash of that message. This module
 * links nothing: the hash functions are the ones Python already loaded, bound at import through
 * `bind` (their addresses, found with ctypes): XXH3_128bits from the xxhash package's extension
 * (the library behind xxhash.xxh3_128_digest) and SHA256_Init/Update/Final from the libcrypto
 * that Python's hashlib uses. The xxh3 digest is written as xxhash's canonical form (high 64 bits
 * first, each big-endian), as xxh3_128_digest returns it.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

enum { ALGO_SHA256 = 0, ALGO_XXH3_128 = 1 };
enum { SHA256_BYTES = 32, XXH3_128_BYTES = 16 };
enum { RELEASE_GIL_FROM_BLOCKS = 64 };  /* below this, releasing the GIL costs more than it frees */

typedef struct { uint64_t low64; uint64_t high64; } xxh128_hash;  /* XXH128_hash_t, by value */
typedef xxh128_hash (*xxh3_128_fn)(const void *data, size_t length);
/* libcrypto's SHA256_CTX is 112 bytes; the context lives in a larger, aligned buffer. */
typedef union { unsigned char bytes[256]; uint64_t align; } sha256_context;
typedef int (*sha256_init_fn)(sha256_context *context);
typedef int (*sha256_update_fn)(sha256_context *context, const void *data, size_t length);
typedef int (*sha256_final_fn)(unsigned char *digest, sha256_context *context);

static xxh3_128_fn xxh3_128 = NULL;
static sha256_init_fn sha256_init = NULL;
static sha256_update_fn sha256_update = NULL;
static sha256_final_fn sha256_final = NULL;

static void store_big_endian_u64(unsigned char *out, uint64_t value) {
    for (int i = 7; i >= 0; i--) {
        out[i] = (unsigned char)(value & 0xFF);
        value >>= 8;
    }
}

/* Hashes `count` messages of `width` bytes; message i is `message` with its token field
 * replaced by block i's tokens and its last `digest_bytes` by the previous digest. */
static int hash_chain(int algo, unsigned char *message, size_t width, size_t tokens_at,
                      const unsigned char *tokens, size_t stride, Py_ssize_t count,
                      unsigned char *digests, size_t digest_bytes) {
    unsigned char *parent_at = message + width - digest_bytes;
    for (Py_ssize_t i = 0; i < count; i++) {
        unsigned char *digest = digests + (size_t)i * digest_bytes;
        memcpy(message + tokens_at, tokens + (size_t)i * stride, stride);
        if (algo == ALGO_XXH3_128) {
            xxh128_hash hash = xxh3_128(message, width);
            store_big_endian_u64(digest, hash.high64);
            store_big_endian_u64(digest + 8, hash.low64);
        } else {
            sha256_context context;
            if (sha256_init(&context) != 1 || sha256_update(&context, message, width) != 1
                    || sha256_final(digest, &context) != 1) {
                return -1;
            }
        }
        memcpy(parent_at, digest, digest_bytes);
    }
    return 0;
}

static PyObject *bind(PyObject *self, PyObject *args) {
    unsigned long long xxh3, init, update, final;
    if (!PyArg_ParseTuple(args, "KKKK", &xxh3, &init, &update, &final)) {
        return NULL;
    }
    xxh3_128 = (xxh3_128_fn)(uintptr_t)xxh3;
    sha256_init = (sha256_init_fn)(uintptr_t)init;
    sha256_update = (sha256_update_fn)(uintptr_t)update;
    sha256_final = (sha256_final_fn)(uintptr_t)final;
    Py_RETURN_NONE;
}

static PyObject *digests_as_list(const unsigned char *digests, Py_ssize_t count, size_t digest_bytes) {
    PyObject *chain = PyList_New(count);
    if (chain == NULL) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *digest = PyBytes_FromStringAndSize((const char *)digests + (size_t)i * digest_bytes,
                                                     (Py_ssize_t)digest_bytes);
        if (digest == NULL) {
            Py_DECREF(chain);
            return NULL;
        }
        PyList_SET_ITEM(chain, i, digest);
    }
    return chain;
}

/* chain(algo, tokens, stride, head, tail, parent) -> list of digests, one per whole block. */
static PyObject *chain(PyObject *self, PyObject *args) {
    int algo;
    Py_ssize_t stride;
    Py_buffer tokens, head, tail, parent;
    if (!PyArg_ParseTuple(args, "iy*ny*y*y*", &algo, &tokens, &stride, &head, &tail, &parent)) {
        return NULL;
    }
    PyObject *result = NULL;
    unsigned char *message = NULL, *digests = NULL;
    size_t digest_bytes = algo == ALGO_XXH3_128 ? XXH3_128_BYTES : SHA256_BYTES;
    int bound = algo == ALGO_XXH3_128 ? xxh3_128 != NULL
                                      : sha256_init != NULL && sha256_update != NULL && sha256_final != NULL;
    if ((algo != ALGO_SHA256 && algo != ALGO_XXH3_128) || !bound) {
        PyErr_Format(PyExc_ValueError, "hash algorithm %d is unknown or not bound", algo);
        goto done;
    }
    if (stride <= 0 || (size_t)parent.len != digest_bytes) {
        PyErr_SetString(PyExc_ValueError, "stride must be positive and parent one digest long");
        goto done;
    }
    Py_ssize_t count = tokens.len / stride;
    size_t width = (size_t)head.len + (size_t)stride + (size_t)tail.len + digest_bytes;
    message = PyMem_Malloc(width);
    digests = PyMem_Malloc(count > 0 ? (size_t)count * digest_bytes : 1);
    if (message == NULL || digests == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    memcpy(message, head.buf, (size_t)head.len);
    memcpy(message + head.len + stride, tail.buf, (size_t)tail.len);
    memcpy(message + width - digest_bytes, parent.buf, digest_bytes);
    int status;
    if (count >= RELEASE_GIL_FROM_BLOCKS) {
        Py_BEGIN_ALLOW_THREADS
        status = hash_chain(algo, message, width, (size_t)head.len, tokens.buf, (size_t)stride, count,
                            digests, digest_bytes);
        Py_END_ALLOW_THREADS
    } else {
        status = hash_chain(algo, message, width, (size_t)head.len, tokens.buf, (size_t)stride, count,
                            digests, digest_bytes);
    }
    if (status != 0) {
        PyErr_SetString(PyExc_RuntimeError, "libcrypto's SHA256 failed");
        goto done;
    }
    result = digests_as_list(digests, count, digest_bytes);
done:
    PyMem_Free(message);
    PyMem_Free(digests);
    PyBuffer_Release(&tokens);
    PyBuffer_Release(&head);
    PyBuffer_Release(&tail);
    PyBuffer_Release(&parent);
    return result;
}

/* One token id as a u32; -1 with an exception set outside [0, 2**32) or for a non-integer. */
static int64_t token_id_u32(PyObject *item) {
    unsigned long value;
    if (PyLong_CheckExact(item)) {
#if PY_VERSION_HEX >= 0x030C0000
        if (PyUnstable_Long_IsCompact((PyLongObject *)item)) {  /* |value| < 2**30: no call */
            Py_ssize_t compact = PyUnstable_Long_CompactValue((PyLongObject *)item);
            if (compact >= 0) {
                return (int64_t)compact;
            }
        }
#else
        Py_ssize_t size = Py_SIZE(item);  /* 0 or 1 digit: 0 <= value < 2**30, read in place */
        if (size == 0) {
            return 0;
        }
        if (size == 1) {
            return (int64_t)((PyLongObject *)item)->ob_digit[0];
        }
#endif
        value = PyLong_AsUnsignedLong(item);
    } else {
        PyObject *index = PyNumber_Index(item);  /* numpy integers; TypeError for a float */
        if (index == NULL) {
            return -1;
        }
        value = PyLong_AsUnsignedLong(index);
        Py_DECREF(index);
    }
    if (value == (unsigned long)-1 && PyErr_Occurred()) {
        return -1;
    }
    if (value > 0xFFFFFFFFUL) {
        PyErr_SetString(PyExc_OverflowError, "a token id does not fit in 32 bits");
        return -1;
    }
    return (int64_t)value;
}

/* pack_u32(list or tuple of ints) -> bytes: each a u32 little-endian. OverflowError for a value
 * outside [0, 2**32), TypeError for a non-integer (what array('I', ...) raises). */
static PyObject *pack_u32(PyObject *self, PyObject *sequence) {
    PyObject *fast = PySequence_Fast(sequence, "pack_u32 takes a list or a tuple");
    if (fast == NULL) {
        return NULL;
    }
    Py_ssize_t count = PySequence_Fast_GET_SIZE(fast);
    PyObject *packed = PyBytes_FromStringAndSize(NULL, count * 4);
    if (packed == NULL) {
        Py_DECREF(fast);
        return NULL;
    }
    unsigned char *out = (unsigned char *)PyBytes_AS_STRING(packed);
    for (Py_ssize_t i = 0; i < count; i++) {
        /* an item's __index__ could change the list: its size is checked, its items re-read */
        int64_t value = PySequence_Fast_GET_SIZE(fast) == count ? token_id_u32(PySequence_Fast_GET_ITEM(fast, i)) : -2;
        if (value == -2) {
            PyErr_SetString(PyExc_RuntimeError, "the token ids changed while being packed");
        }
        if (value < 0) {
            Py_DECREF(packed);
            Py_DECREF(fast);
            return NULL;
        }
        out[4 * i] = (unsigned char)(value & 0xFF);
        out[4 * i + 1] = (unsigned char)((value >> 8) & 0xFF);
        out[4 * i + 2] = (unsigned char)((value >> 16) & 0xFF);
        out[4 * i + 3] = (unsigned char)((value >> 24) & 0xFF);
    }
    Py_DECREF(fast);
    return packed;
}

static PyMethodDef methods[] = {
    {"pack_u32", pack_u32, METH_O, "pack_u32(ints) -> bytes: u32 little-endian each"},
    {"bind", bind, METH_VARARGS, "bind(xxh3_128bits, sha256_init, sha256_update, sha256_final): the hash functions' addresses"},
    {"chain", chain, METH_VARARGS, "chain(algo, tokens, stride, head, tail, parent) -> list[bytes]: the block digests"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_hash_chain", "The block-hash chain in C.", -1, methods};

PyMODINIT_FUNC PyInit__hash_chain(void) {
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && (PyModule_AddIntConstant(m, "SHA256", ALGO_SHA256) < 0
                      || PyModule_AddIntConstant(m, "XXH3_128", ALGO_XXH3_128) < 0)) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
