"""The memory of the host tier (T1): fixed-size slots in one host allocation made at start.

Without CUDA the slab is a POSIX shared-memory segment that a runner can map. With CUDA it is
the same segment, first touched by several threads in parallel and then page-locked with
cudaHostRegister, so device↔host copies are DMA without a staging copy. Dynamo measured this
route (mmap, parallel first touch, cudaHostRegister) at ~0.9 s against ~2.8 s for
cudaHostAlloc of 8 GiB. Each slot starts on a 4 KiB boundary and spans a multiple of 4 KiB, so
a slot can go straight to an O_DIRECT write of the SSD tier.
"""

from __future__ import annotations

import concurrent.futures

import torch

from kvtierd.errors import InvalidArgument
from kvtierd.t0.shm_segment import ShmSegment, default_segment_name
from kvtierd.units import ALIGNMENT_BYTES, round_up

FIRST_TOUCH_CHUNK_BYTES = 64 << 20


def slot_stride(slot_nbytes: int) -> int:
    """Bytes between slot starts: `slot_nbytes` rounded up to ALIGNMENT_BYTES (4 KiB), as T2's slots are."""
    return round_up(slot_nbytes, ALIGNMENT_BYTES)


class HostSlab:
    """`num_slots` slots of `slot_nbytes` bytes; `slots` is a uint8 view `[num_slots, slot_nbytes]`.

    Invariants: slot i starts at byte i * stride of the segment, 4 KiB aligned; the segment is
    created and unlinked by this process (ShmSegment); `pinned` is true iff the memory is
    registered with CUDA, and it is unregistered before the mapping goes.
    """

    def __init__(self, num_slots: int, slot_nbytes: int, pin: bool | None = None, name: str | None = None,
                 num_touch_threads: int = 4) -> None:
        if num_slots < 0 or slot_nbytes <= 0:
            raise InvalidArgument(f"need num_slots >= 0 and slot_nbytes > 0, got {num_slots}, {slot_nbytes}")
        self.num_slots = num_slots
        self.slot_nbytes = slot_nbytes
        self.stride = slot_stride(slot_nbytes)
        nbytes = max(num_slots * self.stride, ALIGNMENT_BYTES)  # an empty tier still maps one page
        self.segment = ShmSegment.create(nbytes, name or default_segment_name("host"), what="host tier")
        flat = self.segment.flat
        assert flat is not None, "just created"
        self.pinned = torch.cuda.is_available() if pin is None else pin
        if self.pinned:
            _first_touch(flat, num_touch_threads)
            _cuda_host_register(flat)
        self.slots: torch.Tensor | None = flat[:num_slots * self.stride].view(num_slots, self.stride)[:, :slot_nbytes]

    @property
    def nbytes(self) -> int:
        return self.num_slots * self.stride

    def close(self) -> None:
        if self.segment.flat is None:
            return
        if self.pinned:
            _cuda_host_unregister(self.segment.flat)
        self.slots = None
        self.segment.close()


def _first_touch(flat: torch.Tensor, num_threads: int) -> None:
    """Fault every page in from several threads at once (torch's fill releases the GIL)."""
    chunks = flat.split(FIRST_TOUCH_CHUNK_BYTES)
    with concurrent.futures.ThreadPoolExecutor(num_threads) as pool:
        list(pool.map(lambda chunk: chunk.zero_(), chunks))


def _cuda_host_register(flat: torch.Tensor) -> None:
    cudart = torch.cuda.cudart()
    assert cudart is not None, "pinned only where CUDA is available"
    error = cudart.cudaHostRegister(flat.data_ptr(), flat.numel(), 0)
    if int(error) != 0:
        raise RuntimeError(f"cudaHostRegister of {flat.numel()} bytes failed with CUDA error {int(error)}")


def _cuda_host_unregister(flat: torch.Tensor) -> None:
    cudart = torch.cuda.cudart()
    assert cudart is not None, "pinned only where CUDA is available"
    cudart.cudaHostUnregister(flat.data_ptr())
