/* A batch of host memory copies in one call: kvtierd/movers/span_copy.py's CPU submission (the
 * copy engine's job for T0 <-> T1 without CUDA), the host twin of one cuMemcpyBatchAsync.
 *
 * copy_spans(dst_addresses, src_addresses, sizes) takes three buffers of native uint64 (numpy
 * arrays: the caller computed the addresses of every span, adjacent runs already coalesced) and
 * memcpys span i from src_addresses[i] to dst_addresses[i], sizes[i] bytes, in order, with the GIL
 * released: one Python step per job, whatever the number of spans. The caller owns the addresses
 * (they lie inside tensors it holds for the length of the call) and that no two spans overlap.
 * Optional, like hash_chain.c: without a C compiler the Python loop of span_copy.py runs.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

enum { RELEASE_GIL_FROM_BYTES = 64 * 1024 };  /* below this, releasing the GIL costs more than it frees */

static int as_u64_array(PyObject *object, Py_buffer *view, const char *what) {
    if (PyObject_GetBuffer(object, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) != 0) {
        return -1;
    }
    const char *format = view->format != NULL ? view->format : "B";
    if (format[0] == '<' || format[0] == '=' || format[0] == '@') {
        format++;
    }
    if (view->itemsize != 8 || (strcmp(format, "Q") != 0 && strcmp(format, "L") != 0)) {
        PyErr_Format(PyExc_TypeError, "%s must be a contiguous buffer of uint64, got format %s", what,
                     view->format != NULL ? view->format : "B");
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static PyObject *copy_spans(PyObject *self, PyObject *args) {
    PyObject *dst_object, *src_object, *size_object;
    if (!PyArg_ParseTuple(args, "OOO", &dst_object, &src_object, &size_object)) {
        return NULL;
    }
    Py_buffer dst_view, src_view, size_view;
    if (as_u64_array(dst_object, &dst_view, "dst_addresses") != 0) {
        return NULL;
    }
    if (as_u64_array(src_object, &src_view, "src_addresses") != 0) {
        PyBuffer_Release(&dst_view);
        return NULL;
    }
    if (as_u64_array(size_object, &size_view, "sizes") != 0) {
        PyBuffer_Release(&dst_view);
        PyBuffer_Release(&src_view);
        return NULL;
    }
    PyObject *result = NULL;
    Py_ssize_t count = size_view.len / 8;
    if (dst_view.len != size_view.len || src_view.len != size_view.len) {
        PyErr_Format(PyExc_ValueError, "copy_spans needs as many addresses as sizes: %zd, %zd and %zd",
                     dst_view.len / 8, src_view.len / 8, count);
        goto done;
    }
    const uint64_t *dsts = (const uint64_t *)dst_view.buf;
    const uint64_t *srcs = (const uint64_t *)src_view.buf;
    const uint64_t *sizes = (const uint64_t *)size_view.buf;
    uint64_t total = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        total += sizes[i];
    }
    if (total >= RELEASE_GIL_FROM_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < count; i++) {
            memcpy((void *)(uintptr_t)dsts[i], (const void *)(uintptr_t)srcs[i], (size_t)sizes[i]);
        }
        Py_END_ALLOW_THREADS
    } else {
        for (Py_ssize_t i = 0; i < count; i++) {
            memcpy((void *)(uintptr_t)dsts[i], (const void *)(uintptr_t)srcs[i], (size_t)sizes[i]);
        }
    }
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&dst_view);
    PyBuffer_Release(&src_view);
    PyBuffer_Release(&size_view);
    return result;
}

static PyMethodDef methods[] = {
    {"copy_spans", copy_spans, METH_VARARGS,
     "copy_spans(dst_addresses, src_addresses, sizes): memcpy each span (uint64 buffers), GIL released."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_copy_spans", NULL, -1, methods};

PyMODINIT_FUNC PyInit__copy_spans(void) { return PyModule_Create(&module); }
