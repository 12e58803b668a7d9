"""Creating and mapping device pools: the CUDA pool where CUDA is, else POSIX shared memory.

The factory sits above the implementations (cuda_pool.py, shm_pool.py) and the interface they
share (device_pool.py), so neither imports the other.
"""

from __future__ import annotations

from typing import Literal

import torch

from kvtierd.errors import InvalidArgument
from kvtierd.layout import Layout
from kvtierd.t0.cuda_pool import CudaDevicePool
from kvtierd.t0.device_pool import DevicePool
from kvtierd.t0.pool_handle import FD_KINDS, PoolHandle, PoolKind, check_num_blocks
from kvtierd.t0.shm_pool import ShmDevicePool


def resolve_device(device: str | torch.device) -> tuple[PoolKind, int | None]:
    """'auto' → cuda:0 if CUDA is available, else shm; 'cpu'/'shm' → shm; 'cuda[:N]' → CUDA."""
    text = str(device)
    if text == "auto":
        return ("cuda_ipc", 0) if torch.cuda.is_available() else ("shm", None)
    if text in ("cpu", "shm"):
        return "shm", None
    if text == "cuda" or text.startswith("cuda:"):
        index_text = text.partition(":")[2] or "0"
        if not index_text.isdigit():
            raise InvalidArgument(f"bad CUDA device {text!r}: expected 'cuda' or 'cuda:N'")
        if not torch.cuda.is_available():
            raise InvalidArgument(
                f"device {text!r} asked for, but CUDA is not available on this machine "
                "(torch.cuda.is_available() is False); use device='auto' or 'shm'")
        index = int(index_text)
        if index >= torch.cuda.device_count():
            raise InvalidArgument(
                f"device {text!r} out of range: {torch.cuda.device_count()} CUDA device(s)")
        return "cuda_ipc", index
    raise InvalidArgument(f"device must be 'auto', 'cpu', 'shm', 'cuda' or 'cuda:N', got {text!r}")


def create_device_pool(layout: Layout, num_blocks: int, device: str | torch.device = "auto",
                       name: str | None = None, cuda_share: Literal["fd", "ipc"] = "fd") -> DevicePool:
    """Create a zeroed pool of `num_blocks` blocks that other processes can attach to.

    `name` picks the shm segment name (shm pools only; default: unique per process).
    `cuda_share` how a CUDA pool is shared: "fd" (a cuMem allocation whose POSIX fd the daemon passes
    over its fd socket; kind "cuda_fd"; the default, tested on an H200), or "ipc" (a cudaIpc handle;
    kind "cuda_ipc": same uid or hostIPC).
    """
    num_blocks = check_num_blocks(num_blocks)
    kind, device_index = resolve_device(device)
    if kind == "shm":
        return ShmDevicePool.create(layout, num_blocks, name=name)
    if name is not None:
        raise InvalidArgument("name applies to shm pools only; a CUDA pool is shared by IPC handle")
    assert device_index is not None
    return CudaDevicePool.create(layout, num_blocks, device_index=device_index, share=cuda_share)


def attach_device_pool(handle: PoolHandle, fd: int | None = None) -> DevicePool:
    """Map a pool that another process created. Closing it never releases the creator's memory.

    With `fd` (a descriptor the creator passed, the caller's to close), an "shm" or "cuda_fd" pool
    is mapped from it and no name is opened; without, an "shm" pool is opened by name (same uid
    only: the segment is mode 0600) and a "cuda_ipc" pool by its IPC handle.
    """
    if not isinstance(handle, PoolHandle):
        raise InvalidArgument(f"expected a PoolHandle, got {type(handle).__name__}")
    if fd is not None:
        if handle.kind == "shm":
            return ShmDevicePool.attach_fd(handle, fd)
        if handle.kind == "cuda_fd":
            return CudaDevicePool.attach_fd(handle, fd)
        raise InvalidArgument(f"a {handle.kind!r} pool is not mapped from a descriptor")
    if handle.kind == "shm":
        return ShmDevicePool.attach(handle)
    if handle.kind == "cuda_fd":
        raise InvalidArgument("a cuda_fd pool is mapped from the descriptor its creator passes (the fd socket)")
    return CudaDevicePool.attach(handle)


def shareable_fd(pool: DevicePool) -> int:
    """The descriptor the creator of `pool` passes to attachers (still the pool's: do not close)."""
    if isinstance(pool, (ShmDevicePool, CudaDevicePool)) and pool.handle.kind in FD_KINDS:
        return pool.shareable_fd
    raise InvalidArgument(f"a {pool.handle.kind!r} pool is not shared by descriptor")
