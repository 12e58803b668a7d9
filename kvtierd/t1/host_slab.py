"""The memory of a host tier (T1): fixed-size slots in one host mapping, backed as far as its extent.

The mapping is a POSIX shared-memory segment of `max_slots` slots (the node's whole host budget:
one layout alone may use all of it), sparse: only the slots [0, num_ready_slots) hold memory. The
extent grows (`extend_to`: the pages committed and first touched in parallel, with CUDA on the GPU's
NUMA node, and page-locked, grain by grain, host_pinning.py) and shrinks (`shrink_to`: the grains past
it unregistered, their pages given back to the system), as the layout's share of the node's budget
moves (host_share.py). Device<->host copies of page-locked slots are DMA without a staging copy.
Dynamo measured this route (mmap, parallel first touch, cudaHostRegister) at ~0.9 s against ~2.8 s
for cudaHostAlloc of 8 GiB. Each slot starts on a 4 KiB boundary and spans a multiple of 4 KiB, so a
slot can go straight to an O_DIRECT write of the SSD tier.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from kvtierd.errors import InvalidArgument
from kvtierd.movers import pinned_regions
from kvtierd.t0.shm_segment import ShmSegment, default_segment_name
from kvtierd.t1.host_pinning import CudaHostRegistrar, HostRegistrar, first_touch, gpu_numa_cpus, grain_slots
from kvtierd.units import ALIGNMENT_BYTES, round_up

STEP_BYTES = 64 << 20  # unpinned, the extent grows this much at a time (pages committed and touched together)


def slot_stride(slot_nbytes: int) -> int:
    """Bytes between slot starts: `slot_nbytes` rounded up to ALIGNMENT_BYTES (4 KiB), as T2's slots are."""
    return round_up(slot_nbytes, ALIGNMENT_BYTES)


class HostSlab:
    """`max_slots` slots of `slot_nbytes` bytes; `slots` is a uint8 view `[max_slots, slot_nbytes]`,
    of which the first `num_ready_slots` hold memory (page-locked when `pinned`).

    Invariants: slot i starts at byte i * stride of the segment, 4 KiB aligned; the segment is
    created and unlinked by this process; pinned, the extent moves in whole grains of `grain_slots`
    (or to max_slots), each grain registered once while inside it and unregistered before the
    mapping goes; only the thread holding `_resize` changes the extent.
    """

    def __init__(self, max_slots: int, slot_nbytes: int, pin: bool | None = None, name: str | None = None,
                 num_touch_threads: int = 4, registrar: HostRegistrar | None = None, grain: int | None = None,
                 what: str = "host tier") -> None:
        """`pin`: page-lock (default: where CUDA is), through `registrar` (default: cudaHostRegister),
        in grains of `grain` slots (default: host_pinning.grain_slots; 1 when not pinned)."""
        if max_slots < 0 or slot_nbytes <= 0:
            raise InvalidArgument(f"need max_slots >= 0 and slot_nbytes > 0, got {max_slots}, {slot_nbytes}")
        self.max_slots = max_slots
        self.slot_nbytes = slot_nbytes
        self.stride = slot_stride(slot_nbytes)
        self.what = what
        nbytes = max(max_slots * self.stride, ALIGNMENT_BYTES)  # an empty tier still maps one page
        self.segment = ShmSegment.create(nbytes, name or default_segment_name("host"), what=what, reserve=False)
        self.flat: torch.Tensor | None = self.segment.flat
        assert self.flat is not None, "just created"
        self.pinned = torch.cuda.is_available() if pin is None else pin
        self.grain_slots = grain or (grain_slots(self.stride) if self.pinned else 1)
        self.registrar = registrar or CudaHostRegistrar() if self.pinned else None
        self.cpus = gpu_numa_cpus() if self.pinned and registrar is None else None
        self.num_touch_threads = num_touch_threads
        self.num_ready_slots = 0
        self._resize = threading.Lock()
        self.slots: torch.Tensor | None = \
            self.flat[:max_slots * self.stride].view(max_slots, self.stride)[:, :slot_nbytes]

    @property
    def nbytes(self) -> int:
        """Bytes the extent holds now."""
        return self.num_ready_slots * self.stride

    @property
    def max_nbytes(self) -> int:
        return self.max_slots * self.stride

    def grain_end(self, num_slots: int) -> int:
        """`num_slots` rounded up to a whole grain (at most max_slots): the extent a target needs."""
        return min(self.max_slots, round_up(num_slots, self.grain_slots))

    def extend_to(self, num_slots: int, on_ready: Callable[[int], None] = lambda num_ready: None) -> None:
        """Give the slots up to `num_slots` (rounded up to a grain) memory, grain by grain (unpinned:
        `STEP_BYTES` at a time), calling `on_ready(num_ready_slots)` after each. Blocking (commits
        and touches pages; pinned: registers them). ResourceExhausted when /dev/shm cannot hold them,
        RuntimeError when a registration fails: the extent keeps the grains done before."""
        with self._resize:
            target = self.grain_end(num_slots)
            step = self.grain_slots if self.pinned else max(1, STEP_BYTES // self.stride)  # registrations: grains
            while self.num_ready_slots < target and self.flat is not None:
                start = self.num_ready_slots
                stop = min(target, self.grain_end(start + step))
                memory = self.flat[start * self.stride:stop * self.stride]
                self.segment.commit(start * self.stride, memory.numel(), self.what)
                # faulted in now, not under the first copies into it (~0.25 ms of daemon CPU per 720 KiB block)
                first_touch(memory, self.num_touch_threads, self.cpus)
                if self.pinned:
                    assert self.registrar is not None
                    self.registrar.register(memory.data_ptr(), memory.numel())
                    pinned_regions.add(memory.data_ptr(), memory.numel())
                self.num_ready_slots = stop
                on_ready(stop)

    def shrink_to(self, num_slots: int) -> int:
        """Give back the memory of the slots from `num_slots` on (rounded up to a grain): their
        grains unregistered, their pages returned to the system. The caller emptied those slots.
        Returns the new extent (`num_ready_slots`)."""
        with self._resize:
            target = self.grain_end(num_slots)
            while self.num_ready_slots > target and self.flat is not None:
                stop = self.num_ready_slots
                start = (stop - 1) // self.grain_slots * self.grain_slots  # the last grain's start
                if self.pinned:
                    assert self.registrar is not None
                    address = self.flat[start * self.stride:].data_ptr()
                    pinned_regions.remove(address, (stop - start) * self.stride)
                    self.registrar.unregister(address)
                self.segment.release(start * self.stride, (stop - start) * self.stride)
                self.num_ready_slots = start
            return self.num_ready_slots

    def close(self) -> None:
        if self.flat is None:
            return
        self.shrink_to(0)
        with self._resize:
            self.slots = self.flat = None
            self.segment.close()
