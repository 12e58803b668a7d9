"""One `cuMemcpyBatchAsync` for a batch of spans: the driver's batched copy, bound by address.

CUDA 12.8 added `cuMemcpyBatchAsync(dsts, srcs, sizes, count, attrs, attrsIdxs, numAttrs, failIdx,
stream)`; CUDA 13.0 dropped `failIdx` and exports that form as `cuMemcpyBatchAsync_v2` (the plain
name keeps the 12.8 form, as the driver keeps every old ABI under its first name). Both are found
in the driver library the process already loaded (libcuda.so.1) with ctypes: `_v2` where the driver
has it, else the 12.8 form on a 12.8+ driver, else none. The span arrays go to the driver as the
numpy arrays' own memory, so a batch of thousands of spans costs no Python step per span (building
lists of cuda-python's CUdeviceptr objects costs ~0.4 µs each). One attribute covers every copy:
`srcAccessOrder = CU_MEMCPY_SRC_ACCESS_ORDER_STREAM` (the sources are read in stream order, after
what the stream did before), no location hints. On an H200 (driver 580) such a batch of shuffled
pinned-host blocks reached 33.8 / 47.7 / 53.3 GB/s for 64 KiB / 256 KiB / 2 MiB blocks, where one
copy per block reached 6.1 / 23.8 / 50.8 and one copy of the whole span 54.

Where the entry point is missing (a driver older than 12.8, no CUDA) or a call fails, `submit`
answers False and the caller copies span by span; the first time, the log says why, once.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import threading

import numpy as np

log = logging.getLogger(__name__)

CU_MEMCPY_SRC_ACCESS_ORDER_STREAM = 1
ATTRIBUTES_NBYTES = 64  # >= sizeof(CUmemcpyAttributes) (24 in CUDA 12.8 and 13.0): zero past its first field
FIRST_BATCHED_DRIVER = 12080


class DriverBatchCopy:
    """The bound entry point. Invariant: `call(dsts, srcs, sizes, count, attrs, idxs, num_attrs[,
    fail_index], stream)` has the argument list of the ABI it was found under (`takes_fail_index`)."""

    def __init__(self, function: ctypes._CFuncPtr, takes_fail_index: bool, name: str) -> None:  # pyright: ignore[reportAttributeAccessIssue]
        self.function = function
        self.takes_fail_index = takes_fail_index
        self.name = name
        argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p,
                    ctypes.c_void_p, ctypes.c_size_t]
        function.argtypes = [*argtypes, ctypes.c_void_p, ctypes.c_void_p] if takes_fail_index else \
            [*argtypes, ctypes.c_void_p]
        function.restype = ctypes.c_int
        self._attributes = ctypes.create_string_buffer(ATTRIBUTES_NBYTES)
        ctypes.c_int.from_buffer(self._attributes).value = CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
        self._attribute_index = (ctypes.c_size_t * 1)(0)

    def __call__(self, dst_addresses: np.ndarray, src_addresses: np.ndarray, sizes: np.ndarray, stream: int) -> int:
        """Enqueue the batch on `stream` (a CUstream handle, 0: the legacy default); the CUresult."""
        count = len(sizes)
        assert dst_addresses.dtype == src_addresses.dtype == sizes.dtype == np.uint64 and \
            len(dst_addresses) == len(src_addresses) == count
        dsts, srcs, nbytes = (np.ascontiguousarray(a) for a in (dst_addresses, src_addresses, sizes))
        args: list[object] = [dsts.ctypes.data, srcs.ctypes.data, nbytes.ctypes.data, count,
                              ctypes.addressof(self._attributes), ctypes.addressof(self._attribute_index), 1]
        if self.takes_fail_index:
            args.append(ctypes.byref(ctypes.c_size_t(0)))
        return int(self.function(*args, ctypes.c_void_p(stream)))


def _driver_library() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


def bind(library: ctypes.CDLL | None) -> tuple[DriverBatchCopy | None, str]:
    """The batched copy of `library` (a CUDA driver), or None and why not."""
    if library is None:
        return None, "no CUDA driver library (libcuda.so.1) in this process"
    version = ctypes.c_int(0)
    try:
        library.cuDriverGetVersion(ctypes.byref(version))
    except AttributeError:
        return None, "the CUDA driver library has no cuDriverGetVersion"
    for name, takes_fail_index, first_version in (("cuMemcpyBatchAsync_v2", False, 13000),
                                                   ("cuMemcpyBatchAsync", True, FIRST_BATCHED_DRIVER)):
        function = getattr(library, name, None)
        if function is not None and version.value >= first_version:
            return DriverBatchCopy(function, takes_fail_index, name), ""
    return None, f"the CUDA driver ({version.value // 1000}.{version.value % 1000 // 10}) has no cuMemcpyBatchAsync " \
                 f"(CUDA >= 12.8 drivers have it)"


class _State:
    """The process's binding, made on first use; `disabled` once a call failed (said once)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.disabled = False


_STATE = _State()


@functools.cache
def _binding() -> DriverBatchCopy | None:
    batch, why_not = bind(_driver_library())
    if batch is None:
        log.warning("T0 <-> T1 copies go span by span (one call a run of blocks): %s", why_not)
    else:
        log.info("T0 <-> T1 copies are one %s per job", batch.name)
    return batch


def submit(dst_addresses: np.ndarray, src_addresses: np.ndarray, sizes: np.ndarray, stream: int) -> bool:
    """Enqueue one batched copy of the spans on `stream`; False when the caller must copy them itself
    (no batched copy in this driver, or it refused: the log says so once, and later calls answer
    False at once)."""
    batch = None if _STATE.disabled else _binding()
    if batch is None:
        return False
    result = batch(dst_addresses, src_addresses, sizes, stream)
    if result == 0:
        return True
    with _STATE.lock:
        if not _STATE.disabled:
            _STATE.disabled = True
            log.warning("%s failed with CUresult %d on a batch of %d spans; copying span by span from now on",
                        batch.name, result, len(sizes))
    return False
