"""The device pool in GPU memory, shared with runner processes through a CUDA IPC handle.

The memory is one dedicated cudaMalloc made with CuPy, not a block of torch's caching
allocator: a cudaIpcMemHandle names a whole allocation, and the runner maps it at offset 0,
so the pool must be exactly that allocation. Torch sees it through DLPack. CuPy is an
optional extra (`pip install 'kvtierd[cuda]'`), imported only here and only when used.

`share="fd"` (the daemon's default, handle kind "cuda_fd") makes the pool a cuMem allocation
exported as a POSIX file descriptor instead (cuda_vmm.py): the daemon passes the fd over its fd
socket to the runner it authorized, which needs neither the daemon's uid nor hostIPC.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Literal

import torch

from kvtierd.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from kvtierd.layout import Layout
from kvtierd.t0.device_pool import DevicePool
from kvtierd.t0.pool_handle import PoolHandle, check_num_blocks

_CUDA_ERROR_MEMORY_ALLOCATION = 2  # cudaErrorMemoryAllocation in the CUDA runtime API


def _import_cupy() -> Any:
    try:
        import cupy  # pyright: ignore[reportMissingImports]  # the optional [cuda] extra
    except ImportError as e:
        raise FailedPrecondition(
            "the CUDA device pool needs CuPy: pip install 'kvtierd[cuda]' "
            "(or use device='shm')") from e
    return cupy


class _DeviceMemory:
    """Owns one raw device pointer; `release(ptr)` runs once, when the last reference goes.

    Every tensor view keeps this object alive (DLPack → CuPy array → UnownedMemory → owner),
    so the pointer is never released under a live view.
    """

    def __init__(self, ptr: int, nbytes: int, device_index: int,
                 release: Callable[[int], None]) -> None:
        self.ptr = ptr
        self.nbytes = nbytes
        self.device_index = device_index
        self._finalizer = weakref.finalize(self, _release_on_device, release, ptr, device_index)
        self._finalizer.atexit = False  # process exit frees device memory and IPC mappings


def _release_on_device(release: Callable[[int], None], ptr: int, device_index: int) -> None:
    cupy = _import_cupy()
    with cupy.cuda.Device(device_index):
        release(ptr)


def _as_pool_tensor(cupy: Any, memory: _DeviceMemory, layout: Layout,
                    num_blocks: int) -> torch.Tensor:
    """A torch view of the whole allocation as `[num_blocks, *layout.block_shape]`."""
    unowned = cupy.cuda.UnownedMemory(memory.ptr, memory.nbytes, memory,
                                      device_id=memory.device_index)
    array = cupy.ndarray((memory.nbytes,), dtype=cupy.uint8,
                         memptr=cupy.cuda.MemoryPointer(unowned, 0))
    flat = torch.from_dlpack(array)  # uint8: CuPy has no bfloat16/fp8; torch reinterprets below
    assert flat.data_ptr() == memory.ptr and flat.device.index == memory.device_index
    return flat.view(layout.torch_dtype).view(num_blocks, *layout.block_shape)


class CudaDevicePool(DevicePool):
    """The pool in one dedicated allocation on `cuda:<device_index>`.

    Invariants: `tensor.data_ptr()` is the base of the allocation (offset 0) and the allocation
    is exactly `nbytes`; the creator zeroes it before anyone can attach. The creator releases it
    (cudaFree) and an attacher unmaps it (cudaIpcCloseMemHandle) after `close()`, as soon as no
    tensor view of it is left alive: at once when the caller kept none. The daemon must not
    close a pool while runners still map it (CUDA: freeing an allocation another process has
    open is undefined). An IPC handle cannot be opened in the process that created it, and
    `device_index` is the creator's numbering: attach with the same CUDA_VISIBLE_DEVICES.
    Writes are stream-ordered: synchronize before another process reads what you wrote.
    """

    def __init__(self, layout: Layout, num_blocks: int, tensor: torch.Tensor,
                 handle: PoolHandle, memory: _DeviceMemory, is_creator: bool) -> None:
        super().__init__(layout, num_blocks, tensor, handle)
        self.is_creator = is_creator
        self._memory: _DeviceMemory | None = memory
        self._export_fd: int | None = None  # the creator's exported fd of a "cuda_fd" pool

    @classmethod
    def create(cls, layout: Layout, num_blocks: int, device_index: int = 0,
               share: Literal["fd", "ipc"] = "ipc") -> CudaDevicePool:
        num_blocks = check_num_blocks(num_blocks)
        if share == "fd":
            return cls._create_exported(layout, num_blocks, device_index)
        cupy = _import_cupy()
        runtime = cupy.cuda.runtime
        nbytes = num_blocks * layout.bytes_per_block
        with cupy.cuda.Device(device_index):
            try:
                ptr = runtime.malloc(nbytes)
            except runtime.CUDARuntimeError as e:
                if e.status == _CUDA_ERROR_MEMORY_ALLOCATION:
                    free_bytes, total_bytes = runtime.memGetInfo()
                    raise ResourceExhausted(
                        f"cuda:{device_index} cannot hold a {nbytes}-byte pool "
                        f"({free_bytes} of {total_bytes} bytes free): lower num_blocks") from None
                raise
            memory = _DeviceMemory(ptr, nbytes, device_index, runtime.free)
            ipc_handle = bytes(runtime.ipcGetMemHandle(ptr))
            tensor = _as_pool_tensor(cupy, memory, layout, num_blocks)
            tensor.zero_()
            torch.cuda.synchronize(tensor.device)  # zeros are visible before the handle leaves
        handle = PoolHandle("cuda_ipc", layout, num_blocks, nbytes, ipc_handle=ipc_handle,
                            device_index=device_index)
        return cls(layout, num_blocks, tensor, handle, memory, is_creator=True)

    @classmethod
    def attach(cls, handle: PoolHandle) -> CudaDevicePool:
        if handle.kind != "cuda_ipc":
            raise InvalidArgument(f"CudaDevicePool cannot attach a {handle.kind!r} handle")
        device_index = _check_attachable(handle)
        cupy = _import_cupy()
        runtime = cupy.cuda.runtime
        with cupy.cuda.Device(device_index):
            ptr = runtime.ipcOpenMemHandle(handle.ipc_handle,
                                           runtime.cudaIpcMemLazyEnablePeerAccess)
            memory = _DeviceMemory(ptr, handle.nbytes, device_index,
                                   runtime.ipcCloseMemHandle)
            tensor = _as_pool_tensor(cupy, memory, handle.layout, handle.num_blocks)
        return cls(handle.layout, handle.num_blocks, tensor, handle, memory, is_creator=False)

    @classmethod
    def _create_exported(cls, layout: Layout, num_blocks: int, device_index: int) -> CudaDevicePool:
        from kvtierd.t0 import cuda_vmm

        cupy = _import_cupy()
        nbytes = num_blocks * layout.bytes_per_block
        with cupy.cuda.Device(device_index), torch.cuda.device(device_index):
            torch.cuda.synchronize(device_index)  # the primary context is current on this thread
            mapping = cuda_vmm.create_exported(nbytes, device_index)
            memory = _DeviceMemory(mapping.ptr, nbytes, device_index, lambda _ptr: mapping.release())
            tensor = _as_pool_tensor(cupy, memory, layout, num_blocks)
            tensor.zero_()
            torch.cuda.synchronize(tensor.device)  # zeros are visible before the fd leaves
        handle = PoolHandle("cuda_fd", layout, num_blocks, nbytes, device_index=device_index)
        pool = cls(layout, num_blocks, tensor, handle, memory, is_creator=True)
        pool._export_fd = mapping.export_fd
        return pool

    @classmethod
    def attach_fd(cls, handle: PoolHandle, fd: int) -> CudaDevicePool:
        """Map a "cuda_fd" pool from the descriptor its creator passed; `fd` stays the caller's."""
        from kvtierd.t0 import cuda_vmm

        if handle.kind != "cuda_fd":
            raise InvalidArgument(f"CudaDevicePool.attach_fd cannot map a {handle.kind!r} handle")
        device_index = _check_attachable(handle)
        cupy = _import_cupy()
        with cupy.cuda.Device(device_index), torch.cuda.device(device_index):
            torch.cuda.synchronize(device_index)
            mapping = cuda_vmm.import_fd(fd, handle.nbytes, device_index)
            memory = _DeviceMemory(mapping.ptr, handle.nbytes, device_index, lambda _ptr: mapping.release())
            tensor = _as_pool_tensor(cupy, memory, handle.layout, handle.num_blocks)
        return cls(handle.layout, handle.num_blocks, tensor, handle, memory, is_creator=False)

    @property
    def shareable_fd(self) -> int:
        """The exported descriptor of a "cuda_fd" pool, for the fd socket to pass (not to be closed)."""
        if self._export_fd is None or self._memory is None:
            raise InvalidArgument("only the creator of an open cuda_fd pool holds its descriptor")
        return self._export_fd

    def close(self) -> None:
        self._export_fd = None  # closed with the allocation (VmmMapping.release)
        if self._tensor is not None:
            torch.cuda.synchronize(self.device)  # no queued kernel still writes the pool
        self._tensor = None
        self._memory = None  # released once the last view of it is gone


def _check_attachable(handle: PoolHandle) -> int:
    """The device index of a CUDA pool handle, if this process can map it there."""
    assert handle.device_index is not None, "PoolHandle checks that a CUDA handle names its device"
    if not torch.cuda.is_available():
        raise FailedPrecondition(f"a {handle.kind} pool handle needs CUDA in this process")
    if handle.device_index >= torch.cuda.device_count():
        raise FailedPrecondition(
            f"the pool is on cuda:{handle.device_index}; this process sees "
            f"{torch.cuda.device_count()} device(s) (CUDA_VISIBLE_DEVICES differs?)")
    return handle.device_index
