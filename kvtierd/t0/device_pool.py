"""The T0 device pool: one block-major tensor that the daemon owns and runners map.

The pool is `[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]` in the layout's
dtype; block `i` is one contiguous span of `layout.bytes_per_block` bytes at offset
`i * bytes_per_block`, so a tier move is one copy per block. A runner's view of layer `l` is
`pool[:, l, 0]` (K) and `pool[:, l, 1]` (V), `[num_blocks, block_size, heads, dim]` with a
block stride.

Two implementations share this interface: `CudaDevicePool` (GPU memory, shared through a CUDA
IPC handle; cuda_pool.py) and `ShmDevicePool` (host POSIX shared memory, shared by name;
shm_pool.py). Another process maps a pool from its `PoolHandle` with `attach_device_pool`.
"""

from __future__ import annotations

import abc
import dataclasses
import operator
from typing import Literal

import numpy as np
import torch

from kvtierd.errors import FailedPrecondition, InvalidArgument
from kvtierd.layout import Layout

PoolKind = Literal["shm", "cuda_ipc"]


@dataclasses.dataclass(frozen=True, slots=True)
class PoolHandle:
    """Everything another process needs to map a pool and rebuild its view.

    `kind == "shm"`: `name` is the segment name under /dev/shm, `device_index` is None.
    `kind == "cuda_ipc"`: `ipc_handle` is the 64-byte cudaIpcMemHandle of an allocation that
    starts at offset 0, `device_index` the CUDA device it lives on (as the creator numbers it).
    """

    kind: PoolKind
    layout: Layout
    num_blocks: int
    nbytes: int
    name: str | None = None
    ipc_handle: bytes | None = None
    device_index: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("shm", "cuda_ipc"):
            raise InvalidArgument(f"pool handle kind must be 'shm' or 'cuda_ipc', got {self.kind!r}")
        _check_num_blocks(self.num_blocks)
        if not isinstance(self.layout, Layout):
            raise InvalidArgument(f"pool handle layout must be a Layout, got {type(self.layout)}")
        if self.nbytes != self.num_blocks * self.layout.bytes_per_block:
            raise InvalidArgument(
                f"pool handle nbytes={self.nbytes} != num_blocks={self.num_blocks} × "
                f"bytes_per_block={self.layout.bytes_per_block}")
        if self.kind == "shm" and not self.name:
            raise InvalidArgument("an shm pool handle needs a segment name")
        if self.kind == "cuda_ipc" and (not self.ipc_handle or self.device_index is None):
            raise InvalidArgument("a cuda_ipc pool handle needs ipc_handle bytes and a device_index")


def _check_num_blocks(num_blocks: object) -> int:
    if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks <= 0:
        raise InvalidArgument(f"num_blocks must be a positive integer, got {num_blocks!r}")
    return num_blocks


def _check_index(value: object, limit: int, what: str) -> int:
    """`value` as an int in [0, limit), or InvalidArgument (bools and floats are refused)."""
    if isinstance(value, bool):
        raise InvalidArgument(f"{what} must be an integer, got {value!r}")
    try:
        index = operator.index(value)
    except TypeError:
        raise InvalidArgument(f"{what} must be an integer, got {value!r}") from None
    if not 0 <= index < limit:
        raise InvalidArgument(f"{what} {index} out of range [0, {limit})")
    return index


class DevicePool(abc.ABC):
    """A block-major KV pool mapped into this process.

    Invariants: `tensor` has shape `(num_blocks, *layout.block_shape)`, dtype
    `layout.torch_dtype`, is contiguous, and spans exactly `nbytes` bytes; block `i` starts
    `i * layout.bytes_per_block` bytes after block 0. Block contents are written by runners and
    copy engines; the pool itself only writes in `copy_block` (and zeroes on creation, CUDA).
    Methods validate block ids before touching memory: a bad id changes nothing. After
    `close()`, `tensor` raises FailedPrecondition; views taken before stay the caller's concern.
    """

    def __init__(self, layout: Layout, num_blocks: int, tensor: torch.Tensor,
                 handle: PoolHandle) -> None:
        assert tensor.shape == (num_blocks, *layout.block_shape), tensor.shape
        assert tensor.dtype == layout.torch_dtype and tensor.is_contiguous()
        assert tensor.numel() * tensor.element_size() == handle.nbytes
        self.layout = layout
        self.num_blocks = num_blocks
        self.handle = handle
        self.device: torch.device = tensor.device
        self._tensor: torch.Tensor | None = tensor  # None once closed

    @property
    def tensor(self) -> torch.Tensor:
        if self._tensor is None:
            raise FailedPrecondition(f"the {self.handle.kind} device pool is closed")
        return self._tensor

    @property
    def closed(self) -> bool:
        return self._tensor is None

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.layout.bytes_per_block

    def _check_block_id(self, block_id: object, what: str = "block_id") -> int:
        return _check_index(block_id, self.num_blocks, what)

    def block(self, block_id: int) -> torch.Tensor:
        """The contiguous view `[num_layers, 2, block_size, heads, dim]` of one block."""
        return self.tensor[self._check_block_id(block_id)]

    def copy_block(self, src_block_id: int, dst_block_id: int) -> None:
        """Copy every byte of one block onto another (copy-on-write). On CUDA: on the current
        stream, so synchronize before another process reads the destination."""
        src = self._check_block_id(src_block_id, "src_block_id")
        dst = self._check_block_id(dst_block_id, "dst_block_id")
        if src != dst:
            self.tensor[dst].copy_(self.tensor[src])

    def block_bytes(self, block_id: int) -> torch.Tensor:
        """One block as `bytes_per_block` uint8 values (a view on CPU pools)."""
        return self.block(block_id).view(-1).view(torch.uint8)

    def read_block(self, block_id: int) -> bytes:
        """A copy of one block's bytes, in block-major order."""
        return self.block_bytes(block_id).cpu().numpy().tobytes()

    def write_block(self, block_id: int, data: bytes | bytearray | memoryview) -> None:
        """Overwrite one block with `bytes_per_block` bytes; InvalidArgument on another length."""
        if len(data) != self.layout.bytes_per_block:
            raise InvalidArgument(f"a block of this layout is {self.layout.bytes_per_block} bytes, got {len(data)}")
        source = np.frombuffer(data, dtype=np.uint8)
        target = self.block_bytes(block_id)
        if target.device.type == "cpu":
            target.numpy()[:] = source
        else:  # a pageable host copy, then one upload
            target.copy_(torch.from_numpy(source.copy()))

    def layer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views `(pool[:, layer, 0], pool[:, layer, 1])`: K and V of one layer for all blocks."""
        layer = _check_index(layer, self.layout.num_layers, "layer")
        return self.tensor[:, layer, 0], self.tensor[:, layer, 1]

    @abc.abstractmethod
    def close(self) -> None:
        """Drop this process's mapping; the creator also releases the memory. Idempotent."""

    def __enter__(self) -> DevicePool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else str(self.device)
        return (f"{type(self).__name__}({self.layout.model_id!r}, num_blocks={self.num_blocks}, "
                f"nbytes={self.nbytes}, {state})")


def _resolve_device(device: str | torch.device) -> tuple[PoolKind, int | None]:
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
                       name: str | None = None) -> DevicePool:
    """Create a zeroed pool of `num_blocks` blocks that other processes can attach to.

    `name` picks the shm segment name (shm pools only; default: unique per process).
    """
    num_blocks = _check_num_blocks(num_blocks)
    kind, device_index = _resolve_device(device)
    if kind == "shm":
        from kvtierd.t0.shm_pool import ShmDevicePool
        return ShmDevicePool.create(layout, num_blocks, name=name)
    if name is not None:
        raise InvalidArgument("name applies to shm pools only; a CUDA pool is shared by IPC handle")
    assert device_index is not None
    from kvtierd.t0.cuda_pool import CudaDevicePool
    return CudaDevicePool.create(layout, num_blocks, device_index=device_index)


def attach_device_pool(handle: PoolHandle) -> DevicePool:
    """Map a pool that another process created. Closing it never releases the creator's memory."""
    if not isinstance(handle, PoolHandle):
        raise InvalidArgument(f"expected a PoolHandle, got {type(handle).__name__}")
    if handle.kind == "shm":
        from kvtierd.t0.shm_pool import ShmDevicePool
        return ShmDevicePool.attach(handle)
    from kvtierd.t0.cuda_pool import CudaDevicePool
    return CudaDevicePool.attach(handle)
