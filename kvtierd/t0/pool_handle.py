"""What another process needs to map a device pool: its kind, layout, size and where it lives.

Plain data without torch, so the client library and kvtierctl can read a pool's handle from the
wire without importing torch; device_pool.py and factory.py map it.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from kvtierd.errors import InvalidArgument
from kvtierd.layout import Layout

PoolKind = Literal["shm", "cuda_fd", "cuda_ipc"]
FD_KINDS = ("shm", "cuda_fd")  # kinds another process maps from a descriptor the creator passes


@dataclasses.dataclass(frozen=True, slots=True)
class PoolHandle:
    """Everything another process needs to map a pool and rebuild its view.

    `kind == "shm"`: `name` is the segment name under /dev/shm, `device_index` is None.
    `kind == "cuda_fd"`: a cuMem allocation exported as a POSIX file descriptor, which the
    creator passes over its fd socket; `device_index` the CUDA device it lives on.
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
        if self.kind not in ("shm", "cuda_fd", "cuda_ipc"):
            raise InvalidArgument(f"pool handle kind must be 'shm', 'cuda_fd' or 'cuda_ipc', got {self.kind!r}")
        check_num_blocks(self.num_blocks)
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
        if self.kind == "cuda_fd" and self.device_index is None:
            raise InvalidArgument("a cuda_fd pool handle needs a device_index")


def check_num_blocks(num_blocks: object) -> int:
    if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks <= 0:
        raise InvalidArgument(f"num_blocks must be a positive integer, got {num_blocks!r}")
    return num_blocks
