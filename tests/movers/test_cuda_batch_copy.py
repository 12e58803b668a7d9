"""The cuMemcpyBatchAsync binding, proven on the CPU against a driver library built here that exports
the two ABIs of cuda.h (12.8: with failIdx; 13.0: `_v2` without) and does the copies on host memory:
the entry point chosen by driver version, every argument in its place (a stream handle in the
failIdx slot would show), one attribute with CU_MEMCPY_SRC_ACCESS_ORDER_STREAM, one call per batch;
a refused batch falls back once and for all, said in the log."""

from __future__ import annotations

import ctypes
import logging
import shutil
import subprocess

import numpy as np
import pytest

from kvtierd.movers import cuda_batch_copy

FAKE_DRIVER = r"""
#include <stdint.h>
#include <string.h>
#include <stddef.h>
int calls = 0, last_order = -1, fail_next = 0;
size_t last_count = 0, last_num_attrs = 0, last_first_index = 99;
uint64_t last_stream = 0;
int cuDriverGetVersion(int *version) { *version = VERSION; return 0; }
static int copy(uint64_t *dsts, uint64_t *srcs, size_t *sizes, size_t count, int *attrs, size_t *first,
                size_t num_attrs, void *stream) {
    calls++; last_count = count; last_num_attrs = num_attrs; last_order = attrs[0]; last_first_index = first[0];
    last_stream = (uint64_t)(uintptr_t)stream;
    if (fail_next) return 1;  /* CUDA_ERROR_INVALID_VALUE */
    for (size_t i = 0; i < count; i++) memcpy((void *)(uintptr_t)dsts[i], (void *)(uintptr_t)srcs[i], sizes[i]);
    return 0;
}
#if VERSION >= 13000
int cuMemcpyBatchAsync_v2(uint64_t *d, uint64_t *s, size_t *z, size_t n, int *a, size_t *i, size_t na, void *st) {
    return copy(d, s, z, n, a, i, na, st);
}
#endif
int cuMemcpyBatchAsync(uint64_t *d, uint64_t *s, size_t *z, size_t n, int *a, size_t *i, size_t na, size_t *fail,
                       void *st) {
    if (fail == NULL) return 1;
    *fail = 0;
    return copy(d, s, z, n, a, i, na, st);
}
"""


def fake_driver(tmp_path, version: int) -> ctypes.CDLL:
    compiler = shutil.which("gcc") or shutil.which("cc")
    assert compiler, "a C compiler builds the stand-in driver (and the package's own extensions)"
    source, library = tmp_path / f"fake_cuda_{version}.c", tmp_path / f"libfake_cuda_{version}.so"
    source.write_text(FAKE_DRIVER)
    subprocess.run([compiler, "-shared", "-fPIC", f"-DVERSION={version}", "-o", str(library), str(source)],
                   check=True)
    return ctypes.CDLL(str(library))


def spans(num_spans: int = 5, nbytes: int = 64):
    src = np.random.default_rng(0).integers(0, 256, (num_spans, nbytes), dtype=np.uint8)
    dst = np.zeros_like(src)
    order = np.arange(num_spans)[::-1].copy()  # reversed: every span somewhere else
    dst_addresses = (dst.ctypes.data + order * nbytes).astype(np.uint64)
    src_addresses = (src.ctypes.data + np.arange(num_spans) * nbytes).astype(np.uint64)
    return dst, src, order, dst_addresses, src_addresses, np.full(num_spans, nbytes, dtype=np.uint64)


@pytest.mark.parametrize("version, name", [(13000, "cuMemcpyBatchAsync_v2"), (12080, "cuMemcpyBatchAsync")])
def test_the_entry_point_of_the_drivers_abi_copies_every_span_in_one_call(tmp_path, version, name):
    library = fake_driver(tmp_path, version)
    batch, why_not = cuda_batch_copy.bind(library)
    assert batch is not None and batch.name == name, why_not
    dst, src, order, dst_addresses, src_addresses, sizes = spans()
    assert batch(dst_addresses, src_addresses, sizes, 0x5EED) == 0
    assert np.array_equal(dst[order], src)
    assert ctypes.c_int.in_dll(library, "calls").value == 1
    assert ctypes.c_size_t.in_dll(library, "last_count").value == 5
    assert ctypes.c_size_t.in_dll(library, "last_num_attrs").value == 1
    assert ctypes.c_size_t.in_dll(library, "last_first_index").value == 0
    assert ctypes.c_int.in_dll(library, "last_order").value == cuda_batch_copy.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
    assert ctypes.c_uint64.in_dll(library, "last_stream").value == 0x5EED


def test_a_driver_before_12_8_or_no_driver_has_no_batched_copy(tmp_path):
    batch, why_not = cuda_batch_copy.bind(fake_driver(tmp_path, 12060))
    assert batch is None and "12.6" in why_not and ">= 12.8" in why_not
    batch, why_not = cuda_batch_copy.bind(None)
    assert batch is None and "libcuda" in why_not


def test_a_refused_batch_falls_back_for_good_and_says_so_once(tmp_path, monkeypatch, caplog):
    library = fake_driver(tmp_path, 13000)
    monkeypatch.setattr(cuda_batch_copy, "_driver_library", lambda: library)
    monkeypatch.setattr(cuda_batch_copy, "_STATE", cuda_batch_copy._State())
    cuda_batch_copy._binding.cache_clear()
    try:
        dst, src, order, dst_addresses, src_addresses, sizes = spans()
        assert cuda_batch_copy.submit(dst_addresses, src_addresses, sizes, 0)
        assert np.array_equal(dst[order], src)
        ctypes.c_int.in_dll(library, "fail_next").value = 1
        with caplog.at_level(logging.WARNING, logger=cuda_batch_copy.__name__):
            assert not cuda_batch_copy.submit(dst_addresses, src_addresses, sizes, 0)
            assert not cuda_batch_copy.submit(dst_addresses, src_addresses, sizes, 0)
        assert ctypes.c_int.in_dll(library, "calls").value == 2  # the third never reached the driver
        assert len([r for r in caplog.records if "span by span" in r.getMessage()]) == 1
    finally:
        cuda_batch_copy._binding.cache_clear()
