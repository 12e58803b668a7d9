"""The T0 device pool: one block-major tensor that the daemon owns and runners map.

The pool is `[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]` in the layout's
dtype; block `i` is one contiguous span of `layout.bytes_per_block` bytes at offset
`i * bytes_per_block`, so a tier move is one copy per block. A runner's view of layer `l` is
`pool[:, l, 0]` (K) and `pool[:, l, 1]` (V), `[num_blocks, block_size, heads, dim]` with a
block stride.

Two implementations share this interface: `CudaDevicePool` (GPU memory, shared through a CUDA
IPC handle; cuda_pool.py) and `ShmDevicePool` (host POSIX shared memory, shared by name;
shm_pool.py). factory.py creates one (`create_device_pool`); another process maps it from its
`PoolHandle` (pool_handle.py) with `attach_device_pool`.
"""

from __future__ import annotations

import abc
import operator
from typing import SupportsIndex, cast

import numpy as np
import torch

from kvtierd.errors import FailedPrecondition, InvalidArgument
from kvtierd.layout import Layout
from kvtierd.t0.pool_handle import PoolHandle


def _check_index(value: object, limit: int, what: str) -> int:
    """`value` as an int in [0, limit), or InvalidArgument (bools and floats are refused)."""
    if isinstance(value, bool):
        raise InvalidArgument(f"{what} must be an integer, got {value!r}")
    try:
        index = operator.index(cast(SupportsIndex, value))  # TypeError, caught, where it has no __index__
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
