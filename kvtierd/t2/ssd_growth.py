"""How far a layout's SSD slot files extend, against the node's disk budget (node_budget.py,
shared by every layout's tier): they grow as blocks are written and give their end back when
another layout needs the disk.

Growth comes in chunks the budget grants (a chunk at a time while the tier is below its fair
share), never past the tier's capacity; a tier below its fair share first asks the tier furthest
above its share to give back. Giving back drops the blocks at the end of the files, deletes
their LMDB records, and only then truncates the files. The extent changes only under the tier's
write lock, files and slot index together.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from kvtierd.index.extent_slot_index import ExtentSlotIndex
from kvtierd.t2.node_budget import NodeBudget
from kvtierd.t2.ssd_files import SlotFiles

log = logging.getLogger(__name__)

GROW_CHUNK_BYTES = 64 << 20  # the files grow by at least this much at a time (or what the budget has)


def take_budget(budget: NodeBudget, key: str, held_bytes: int, num_existing_slots: int, stride: int) -> int:
    """Make `key`'s part of the budget (`held_bytes` now) cover exactly what its files keep of the
    `num_existing_slots` they hold (all, when the budget has room); returns those slots."""
    want = num_existing_slots * stride
    if held_bytes > want:
        budget.release(key, held_bytes - want)
    elif held_bytes < want:
        held_bytes += budget.reserve(key, want - held_bytes, unit=stride)
    extent = min(num_existing_slots, held_bytes // stride)
    if extent * stride < held_bytes:
        budget.release(key, held_bytes - extent * stride)
    return extent


class SsdGrowth:
    """Grows and shrinks one tier's extent: its slot files and its slot index together, with the
    bytes taken from or given back to the budget. `write_lock` is the tier's (see ssd_tier.py);
    `commit_index(where, deletes=...)` its LMDB transaction, called under that lock;
    `stop_admitting(error, where)` is told when the disk cannot hold what the budget granted."""

    def __init__(self, budget: NodeBudget, key: str, files: SlotFiles, index: ExtentSlotIndex,
                 write_lock: threading.Lock, commit_index: Callable[..., bool],
                 stop_admitting: Callable[[BaseException, str], None]) -> None:
        self.budget, self.key = budget, key
        self.stride = files.stride
        self._files, self._index = files, index
        self._write_lock = write_lock
        self._commit_index = commit_index
        self._stop_admitting = stop_admitting
        self._grow_slots = max(1, GROW_CHUNK_BYTES // self.stride)

    def make_room(self, num_blocks: int) -> None:
        """Grow the files for `num_blocks` new blocks when the free slots lack them and the budget
        grants it (a chunk at a time while under its fair share); a tier under its fair share
        first asks the others to give back. Called outside `write_lock` (a shed takes the other
        tier's). When nothing is granted the store reuses this tier's least recently used slots."""
        index = self._index
        num_missing = min(num_blocks - index.num_free_slots, index.max_slots - index.num_slots)
        if num_missing <= 0:
            return
        if self.budget.free_bytes < num_missing * self.stride:  # ask for a chunk: fewer, larger extents
            self.budget.make_room(self.key, self._num_wanted(num_missing) * self.stride,
                                  needed_bytes=num_missing * self.stride)
        with self._write_lock:
            extent = index.num_slots
            num_missing = min(num_blocks - index.num_free_slots, index.max_slots - extent)
            if num_missing <= 0:
                return
            num_wanted = self._num_wanted(num_missing)
            granted = self.budget.reserve(self.key, num_wanted * self.stride, unit=self.stride)
            num_granted = granted // self.stride
            if not num_granted:
                return
            try:
                self._files.resize(extent + num_granted)
            except OSError as error:  # the disk cannot hold what the budget granted
                self.budget.release(self.key, num_granted * self.stride)
                self._stop_admitting(error, "slot file growth")
                return
            index.grow(num_granted)

    def _num_wanted(self, num_missing: int) -> int:
        """Slots to grow by for `num_missing`: a chunk while under the fair share, else what is missing."""
        share = self.budget.share(self.key)
        num_below_share = max(0, share.share_bytes - share.held_bytes) // self.stride
        num_slots_left = self._index.max_slots - self._index.num_slots
        return min(max(num_missing, min(self._grow_slots, num_below_share)), num_slots_left)

    def shed(self, nbytes: int) -> int:
        """Give back at least `nbytes` of disk to the budget (another layout needs it): drop the
        blocks at the end of the files and truncate them. Returns the bytes given back (fewer when
        stores or loads hold slots there). The caller keeps the tier open meanwhile."""
        with self._write_lock:
            extent = self._index.num_slots
            dropped = self._index.shrink(extent - -(-nbytes // self.stride))
            new_extent = self._index.num_slots
            if new_extent == extent:
                return 0
            self._commit_index("give back disk", deletes=[e.block_hash for e in dropped])  # before truncating
            try:
                self._files.resize(new_extent)
            except OSError as error:
                log.error("SSD tier: truncating the slot files failed: %s", error)
            released = (extent - new_extent) * self.stride
            self.budget.release(self.key, released)
        log.info("SSD tier %s: gave back %d bytes of disk to another layout (%d blocks dropped)",
                 self.key, released, len(dropped))
        return released
