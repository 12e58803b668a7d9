"""The host tier (T1): slots of pinned (or shared) host memory and the index over them; while the
slab is being page-locked (host_slab.py), the index covers the pinned part and grows with it."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from kvtierd.daemon_key import DaemonKey
from kvtierd.index.extent_slot_index import ExtentSlotIndex
from kvtierd.index.index_events import Doorbell, IndexEvent
from kvtierd.index.slot_index import slots_within
from kvtierd.layout import Layout
from kvtierd.movers.block_codec import make_codec
from kvtierd.t1.host_slab import HostSlab, slot_stride


class HostTier:
    """`capacity_bytes` of host memory cut into one slot per block (in the codec's bytes).

    Inclusive with T0: a hash may live in both. The tier itself moves no bytes: the tier manager
    copies through the copy engine, bracketing each copy with the index's two phases.
    """

    def __init__(self, layout: Layout, capacity_bytes: int, codec: str = "raw", pin: bool | None = None,
                 clock: Callable[[], float] = time.monotonic, slab: HostSlab | None = None) -> None:
        """`slab`: the memory (default: a new HostSlab of `capacity_bytes`, page-locked where CUDA is).
        A slab being page-locked serves its pinned slots at once, the rest as they are pinned."""
        self.codec = make_codec(codec, layout)
        self.slab = slab or HostSlab(capacity_bytes // slot_stride(self.codec.slot_nbytes), self.codec.slot_nbytes, pin,
                                     what=f"T1 of {layout.model_id}")
        assert self.slab.slot_nbytes == self.codec.slot_nbytes
        self.index = ExtentSlotIndex(self.slab.num_slots, self.slab.num_ready_slots, clock)
        self.slab.start_pinning(self._grow_to)

    def _grow_to(self, num_ready_slots: int) -> None:
        """The slab's slots up to `num_ready_slots` are pinned: the index may hand them out."""
        if num_ready_slots > self.index.num_slots:
            self.index.grow(num_ready_slots - self.index.num_slots)

    @property
    def slots(self) -> torch.Tensor:
        """uint8 `[num_slots, slot_nbytes]`, one row a block."""
        slots = self.slab.slots
        assert slots is not None, "the host tier is closed"
        return slots

    @property
    def capacity_bytes(self) -> int:
        return self.slab.nbytes

    @property
    def pinned_bytes(self) -> int:
        """Page-locked so far: the slots the tier may use (0 where T1 is not pinned: every slot is usable)."""
        return self.slab.pinned_bytes

    @property
    def pinning(self) -> bool:
        """Is the slab still being page-locked (the tier serving its pinned part meanwhile)?"""
        return self.slab.pinned and self.index.num_slots < self.slab.num_slots and not self.slab.pinning_stopped

    @property
    def used_bytes(self) -> int:
        return self.index.num_used_slots * self.slab.stride

    def enable_events(self, max_pending: int, doorbell: Doorbell | None = None) -> None:
        """Queue stored/removed events of this tier (SlotIndex.enable_events), for the KV event feed."""
        self.index.enable_events(max_pending, doorbell)

    def take_events(self) -> list[IndexEvent]:
        return self.index.take_events()

    def set_owner_quota(self, owner_of: Callable[[DaemonKey], bytes],
                        limit_bytes: Callable[[bytes], int | None]) -> None:
        """Per-owner byte limits (None = none), enforced in slots; see SlotIndex.set_owner_quota."""
        self.index.set_owner_quota(owner_of, lambda owner: slots_within(limit_bytes(owner), self.slab.stride))

    def close(self) -> None:
        self.slab.close()
