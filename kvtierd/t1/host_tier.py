"""The host tier (T1): slots of pinned (or shared) host memory and the index over them, as many as
the layout's share of the node's host budget holds now (host_share.py); the slab (host_slab.py) and
the index grow and shrink together as that share moves."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from kvtierd.daemon_key import DaemonKey
from kvtierd.index.extent_slot_index import ExtentSlotIndex
from kvtierd.index.index_events import Doorbell, IndexEvent
from kvtierd.index.owner_slots import slots_within
from kvtierd.layout import Layout
from kvtierd.movers.block_codec import make_codec
from kvtierd.t1.host_share import HostShare
from kvtierd.t1.host_slab import HostSlab, slot_stride
from kvtierd.t2.node_budget import NodeBudget


class HostTier:
    """Host memory cut into one slot per block (in the codec's bytes), sized by a budget.

    Inclusive with T0: a hash may live in both. The tier itself moves no bytes: the tier manager
    copies through the copy engine, bracketing each copy with the index's two phases.
    """

    def __init__(self, layout: Layout, capacity_bytes: int, codec: str = "raw", pin: bool | None = None,
                 clock: Callable[[], float] = time.monotonic, budget: NodeBudget | None = None, key: str = "",
                 slab: HostSlab | None = None, idle_s: float = 0.0) -> None:
        """`budget`: the node's host budget this tier shares with other layouts' (None: a budget of its
        own of `capacity_bytes`), `key` its name there. `slab`: the memory (default: a HostSlab that can
        hold the whole budget, page-locked where CUDA is, backed only as far as the share goes). `idle_s`:
        unused this long, the tier lets the other layouts take its share (0: never idle)."""
        self.codec = make_codec(codec, layout)
        budget = budget if budget is not None else NodeBudget(capacity_bytes, "host")
        stride = slot_stride(self.codec.slot_nbytes)
        self.slab = slab or HostSlab(budget.capacity_bytes // stride, self.codec.slot_nbytes, pin,
                                     what=f"T1 of {layout.model_id}")
        assert self.slab.slot_nbytes == self.codec.slot_nbytes
        self.index = ExtentSlotIndex(self.slab.max_slots, 0, clock)
        self.share = HostShare(self.slab, self.index, budget, key or layout.model_id, idle_s)
        self.share.start()

    @property
    def slots(self) -> torch.Tensor:
        """uint8 `[num_slots, slot_nbytes]`, one row a block."""
        slots = self.slab.slots
        assert slots is not None, "the host tier is closed"
        return slots

    @property
    def capacity_bytes(self) -> int:
        """What the tier holds now: its share of the budget (it moves with demand)."""
        return self.slab.nbytes

    @property
    def pinned_bytes(self) -> int:
        """Page-locked now (with CUDA: the whole extent; 0 where T1 is not page-locked)."""
        return self.slab.nbytes if self.slab.pinned else 0

    @property
    def pinning(self) -> bool:
        """Is the slab being page-locked now (the tier serving the part pinned so far)?"""
        return self.slab.pinned and self.share.growing

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
        self.share.close()
        self.slab.close()
