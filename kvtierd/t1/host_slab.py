"""The memory of the host tier (T1): fixed-size slots in one host allocation made at start.

Without CUDA the slab is a POSIX shared-memory segment that a runner can map, every slot usable at
once. With CUDA it is the same segment, page-locked in the background (host_pinning.py: chunks of at
most 64 GiB on slot boundaries, each first touched by several threads on the GPU's NUMA node, then
registered with cudaHostRegister), so device↔host copies are DMA without a staging copy; the tier
uses the slots pinned so far, a prefix of the slab that grows until the whole is pinned. Dynamo
measured this route (mmap, parallel first touch, cudaHostRegister) at ~0.9 s against ~2.8 s for
cudaHostAlloc of 8 GiB. Each slot starts on a 4 KiB boundary and spans a multiple of 4 KiB, so a
slot can go straight to an O_DIRECT write of the SSD tier.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvtierd.errors import InvalidArgument
from kvtierd.t0.shm_segment import ShmSegment, default_segment_name
from kvtierd.t1.host_pinning import CudaHostRegistrar, HostRegistrar, SlabPinner, gpu_numa_cpus, registration_chunks
from kvtierd.units import ALIGNMENT_BYTES, round_up


def slot_stride(slot_nbytes: int) -> int:
    """Bytes between slot starts: `slot_nbytes` rounded up to ALIGNMENT_BYTES (4 KiB), as T2's slots are."""
    return round_up(slot_nbytes, ALIGNMENT_BYTES)


class HostSlab:
    """`num_slots` slots of `slot_nbytes` bytes; `slots` is a uint8 view `[num_slots, slot_nbytes]`.

    Invariants: slot i starts at byte i * stride of the segment, 4 KiB aligned; the segment is
    created and unlinked by this process (ShmSegment); `pinned` is true iff the memory is (being)
    registered with CUDA; then only the slots [0, num_ready_slots) are page-locked and may be used,
    and every registration is undone before the mapping goes. Unpinned, every slot is ready.
    """

    def __init__(self, num_slots: int, slot_nbytes: int, pin: bool | None = None, name: str | None = None,
                 num_touch_threads: int = 4, registrar: HostRegistrar | None = None,
                 chunks: list[tuple[int, int]] | None = None, what: str = "host tier") -> None:
        """`pin`: page-lock (default: where CUDA is); `registrar` does it (default: cudaHostRegister) in
        `chunks` of slots (default: host_pinning.registration_chunks), once `start_pinning` is called;
        its log lines name the slab `what`."""
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
        self.pinner: SlabPinner | None = None
        if self.pinned:
            self.pinner = SlabPinner(flat, self.stride, chunks or registration_chunks(num_slots, self.stride),
                                     registrar or CudaHostRegistrar(), lambda num_ready: None, num_touch_threads,
                                     gpu_numa_cpus() if registrar is None else None, what)
        self.slots: torch.Tensor | None = flat[:num_slots * self.stride].view(num_slots, self.stride)[:, :slot_nbytes]

    @property
    def nbytes(self) -> int:
        return self.num_slots * self.stride

    @property
    def num_ready_slots(self) -> int:
        """Slots the tier may use: all when unpinned, the pinned prefix while pinning."""
        return self.num_slots if self.pinner is None else self.pinner.num_ready_slots

    @property
    def pinned_bytes(self) -> int:
        """Bytes page-locked so far (0 when unpinned)."""
        return 0 if self.pinner is None else self.pinner.pinned_bytes

    @property
    def pinning_stopped(self) -> bool:
        """Did pinning stop before the end (an error: the tier keeps what was pinned)?"""
        return self.pinner is not None and self.pinner.error is not None

    def start_pinning(self, on_ready: Callable[[int], None]) -> None:
        """Begin page-locking in the background; `on_ready(num_ready_slots)` after each chunk (on the
        pinning thread). Unpinned: nothing to do, every slot is ready already."""
        if self.pinner is not None:
            self.pinner.on_ready = on_ready
            self.pinner.start()

    def wait_pinned(self, timeout_s: float | None = None) -> bool:
        """Until pinning has finished (or stopped on an error); False on timeout."""
        return True if self.pinner is None else self.pinner.wait(timeout_s)

    def close(self) -> None:
        if self.segment.flat is None:
            return
        if self.pinner is not None:
            self.pinner.close()
        self.slots = None
        self.segment.close()
