"""The device pool without CUDA: a POSIX shared-memory segment under /dev/shm (shm_segment.py)."""

from __future__ import annotations

from kvtierd.errors import InvalidArgument
from kvtierd.layout import Layout
from kvtierd.t0.device_pool import DevicePool
from kvtierd.t0.pool_handle import PoolHandle, check_num_blocks
from kvtierd.t0.shm_segment import ShmSegment, default_segment_name


class ShmDevicePool(DevicePool):
    """The pool in a POSIX shared-memory segment, `/dev/shm/<name>`, mapped MAP_SHARED.

    Invariants and ownership are the segment's (ShmSegment): exactly `nbytes`, mode 0600,
    created O_EXCL, reserved up front, unlinked by the creating process only. Attachers only
    drop their mapping; mappings still open stay valid after the unlink.
    """

    def __init__(self, layout: Layout, num_blocks: int, segment: ShmSegment, handle: PoolHandle) -> None:
        assert segment.flat is not None, "a segment just created or attached is open"
        tensor = segment.flat.view(layout.torch_dtype).view(num_blocks, *layout.block_shape)
        super().__init__(layout, num_blocks, tensor, handle)
        self.segment = segment
        self.path = segment.path
        self.is_creator = segment.is_creator

    @classmethod
    def create(cls, layout: Layout, num_blocks: int, name: str | None = None) -> ShmDevicePool:
        num_blocks = check_num_blocks(num_blocks)
        nbytes = num_blocks * layout.bytes_per_block
        segment = ShmSegment.create(nbytes, name if name is not None else default_segment_name("pool"),
                                    what="device pool")
        return cls(layout, num_blocks, segment, PoolHandle("shm", layout, num_blocks, nbytes, name=segment.name))

    @classmethod
    def attach(cls, handle: PoolHandle) -> ShmDevicePool:
        if handle.kind != "shm":
            raise InvalidArgument(f"ShmDevicePool cannot attach a {handle.kind!r} handle")
        assert handle.name is not None, "PoolHandle checks that an shm handle names its segment"
        return cls(handle.layout, handle.num_blocks, ShmSegment.attach(handle.name, handle.nbytes), handle)

    @classmethod
    def attach_fd(cls, handle: PoolHandle, fd: int) -> ShmDevicePool:
        """Map the pool from a descriptor of its segment (the daemon's fd socket); the name is never
        opened, so this works for another uid than the creator's. `fd` stays the caller's to close."""
        if handle.kind != "shm":
            raise InvalidArgument(f"ShmDevicePool cannot attach a {handle.kind!r} handle")
        assert handle.name is not None, "PoolHandle checks that an shm handle names its segment"
        return cls(handle.layout, handle.num_blocks, ShmSegment.from_fd(fd, handle.nbytes, handle.name), handle)

    @property
    def shareable_fd(self) -> int:
        """The creator's descriptor of the segment, for the fd socket to pass (not to be closed)."""
        if self.segment.fd is None:
            raise InvalidArgument("only the creator of an open shm pool holds its descriptor")
        return self.segment.fd

    def close(self) -> None:
        self._tensor = None
        self.segment.close()
