"""CUDA virtual memory management (cuMem*) through the driver API, for a device pool that another
process maps from a POSIX file descriptor.

cudaIpc handles name an allocation by a 64-byte token that any process on the node may open (in
the creator's IPC namespace); a cuMem allocation made with CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
is exported as an fd instead, which the daemon passes over its unix fd socket (SCM_RIGHTS) to the
runner it authorized, whatever its uid, without hostIPC. The calls are the driver's own
(libcuda.so.1 through ctypes): creator `cuMemCreate` → `cuMemAddressReserve` → `cuMemMap` →
`cuMemSetAccess` → `cuMemExportToShareableHandle`; importer `cuMemImportFromShareableHandle` and
the same reserve / map / set-access. Sizes are rounded up to the allocation granularity; both
sides round alike (same device, same properties).

Only cuda_pool.py imports this, and only on a machine with CUDA: nothing here runs without it.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import os

from kvtierd.errors import FailedPrecondition, ResourceExhausted

CU_MEM_ALLOCATION_TYPE_PINNED = 1
CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1
CU_MEM_LOCATION_TYPE_DEVICE = 1
CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3
CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0
CUDA_SUCCESS = 0
CUDA_ERROR_OUT_OF_MEMORY = 2


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _AllocationProp(ctypes.Structure):  # CUmemAllocationProp
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", _Location),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", _AllocFlags)]


class _AccessDesc(ctypes.Structure):  # CUmemAccessDesc
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


@functools.cache
def _driver() -> ctypes.CDLL:
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        raise FailedPrecondition(f"the CUDA driver library (libcuda.so.1) cannot be loaded: {e}") from None


def _check(status: int, call: str) -> None:
    if status == CUDA_SUCCESS:
        return
    name = ctypes.c_char_p()
    _driver().cuGetErrorName(status, ctypes.byref(name))
    text = name.value.decode() if name.value else f"CUresult {status}"
    if status == CUDA_ERROR_OUT_OF_MEMORY:
        raise ResourceExhausted(f"{call}: {text}")
    raise FailedPrecondition(f"{call} failed: {text}")


def _prop(device_index: int) -> _AllocationProp:
    prop = _AllocationProp()
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED
    prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    prop.location = _Location(CU_MEM_LOCATION_TYPE_DEVICE, device_index)
    return prop


def padded_size(nbytes: int, device_index: int) -> int:
    """`nbytes` rounded up to the device's allocation granularity."""
    granularity = ctypes.c_size_t()
    prop = _prop(device_index)
    _check(_driver().cuMemGetAllocationGranularity(ctypes.byref(granularity), ctypes.byref(prop),
                                                   CU_MEM_ALLOC_GRANULARITY_MINIMUM), "cuMemGetAllocationGranularity")
    step = granularity.value
    return -(-nbytes // step) * step


@dataclasses.dataclass(slots=True)
class VmmMapping:
    """A cuMem allocation (`handle`) mapped read-write at `ptr` for `size` bytes on one device.
    `export_fd` is the creator's exported descriptor (None for an importer). Call `release()` once."""

    ptr: int
    size: int
    handle: int
    device_index: int
    export_fd: int | None = None

    def release(self) -> None:
        driver = _driver()
        _check(driver.cuMemUnmap(ctypes.c_uint64(self.ptr), ctypes.c_size_t(self.size)), "cuMemUnmap")
        _check(driver.cuMemAddressFree(ctypes.c_uint64(self.ptr), ctypes.c_size_t(self.size)), "cuMemAddressFree")
        _check(driver.cuMemRelease(ctypes.c_uint64(self.handle)), "cuMemRelease")
        if self.export_fd is not None:
            os.close(self.export_fd)
            self.export_fd = None


def create_exported(nbytes: int, device_index: int) -> VmmMapping:
    """Allocate at least `nbytes` on the (current) device, map it here, export it as a POSIX fd.
    The caller has made the device's primary context current (torch.cuda.device)."""
    driver = _driver()
    size = padded_size(nbytes, device_index)
    handle = ctypes.c_uint64()
    prop = _prop(device_index)
    _check(driver.cuMemCreate(ctypes.byref(handle), ctypes.c_size_t(size), ctypes.byref(prop),
                              ctypes.c_uint64(0)), f"cuMemCreate of {size} bytes on cuda:{device_index}")
    try:
        mapping = _map(handle.value, size, device_index)
    except BaseException:
        driver.cuMemRelease(handle)
        raise
    fd = ctypes.c_int(-1)
    try:
        _check(driver.cuMemExportToShareableHandle(ctypes.byref(fd), ctypes.c_uint64(handle.value),
                                                   CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, ctypes.c_uint64(0)),
               "cuMemExportToShareableHandle")
    except BaseException:
        mapping.release()
        raise
    mapping.export_fd = fd.value
    return mapping


def import_fd(fd: int, nbytes: int, device_index: int) -> VmmMapping:
    """Map the allocation exported as `fd` (received from its creator); `fd` stays the caller's."""
    driver = _driver()
    size = padded_size(nbytes, device_index)
    handle = ctypes.c_uint64()
    _check(driver.cuMemImportFromShareableHandle(ctypes.byref(handle), ctypes.c_void_p(fd),
                                                 CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
           "cuMemImportFromShareableHandle")
    try:
        return _map(handle.value, size, device_index)
    except BaseException:
        driver.cuMemRelease(ctypes.c_uint64(handle.value))
        raise


def _map(handle: int, size: int, device_index: int) -> VmmMapping:
    driver = _driver()
    ptr = ctypes.c_uint64()
    _check(driver.cuMemAddressReserve(ctypes.byref(ptr), ctypes.c_size_t(size), ctypes.c_size_t(0),
                                      ctypes.c_uint64(0), ctypes.c_uint64(0)), "cuMemAddressReserve")
    try:
        _check(driver.cuMemMap(ptr, ctypes.c_size_t(size), ctypes.c_size_t(0), ctypes.c_uint64(handle),
                               ctypes.c_uint64(0)), "cuMemMap")
        access = _AccessDesc(_Location(CU_MEM_LOCATION_TYPE_DEVICE, device_index), CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
        _check(driver.cuMemSetAccess(ptr, ctypes.c_size_t(size), ctypes.byref(access), ctypes.c_size_t(1)),
               "cuMemSetAccess")
    except BaseException:
        driver.cuMemUnmap(ptr, ctypes.c_size_t(size))
        driver.cuMemAddressFree(ptr, ctypes.c_size_t(size))
        raise
    return VmmMapping(ptr.value, size, handle, device_index)
