"""A slot index over a growing extent: slots `[0, num_slots)` of at most `max_slots` are usable now.

The SSD tier's extent is what its slot files hold: it grows as blocks are written (taking disk from
the node's budget) and shrinks from the end when another layout needs the disk. The host tier's is
the part of its slab page-locked so far (t1/host_pinning.py): it grows chunk by chunk at start.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from kvtierd.daemon_key import DaemonKey
from kvtierd.index.slot_entry import SlotEntry
from kvtierd.index.slot_index import SlotIndex


class ExtentSlotIndex(SlotIndex):
    """A SlotIndex whose `num_slots` (the extent) changes: `grow` adds free slots at the end,
    `shrink` drops the end. Invariants of SlotIndex hold over the extent; `max_slots` bounds it.
    New slots are handed out after the free slots already there, lowest first, so a layout's
    blocks stay at the start of its files and `shrink` has less to drop."""

    def __init__(self, max_slots: int, num_slots: int, clock: Callable[[], float] = time.monotonic) -> None:
        assert 0 <= num_slots <= max_slots, (num_slots, max_slots)
        super().__init__(num_slots, clock)
        self.max_slots = max_slots

    @property
    def num_free_slots(self) -> int:
        with self._lock:
            return len(self._free_slots)

    def holds(self, block_hash: DaemonKey) -> bool:
        """Is the block here, stored or being stored?"""
        with self._lock:
            return block_hash in self._entries

    def grow(self, num_new_slots: int) -> None:
        with self._lock:
            old = self.num_slots
            assert old + num_new_slots <= self.max_slots, (old, num_new_slots, self.max_slots)
            self._free_slots[:0] = range(old + num_new_slots - 1, old - 1, -1)  # popped last, lowest first
            self.num_slots = old + num_new_slots
            self._room_changed()

    def shrink(self, num_slots: int) -> list[SlotEntry]:
        """Cut the extent to `num_slots`, or to just past the last slot a store or load holds
        (those cannot go). The entries past it are dropped and returned; the extent is then
        `self.num_slots`."""
        with self._lock:
            busy = max((e.slot for e in self._entries.values() if e.storing or e.num_loads), default=-1)
            new = min(self.num_slots, max(num_slots, busy + 1))
            dropped = [e for e in self._entries.values() if e.slot >= new]
            for entry in dropped:
                del self._lru[entry.block_hash]
                self._delete(entry.block_hash)
                self._removed(entry)
            self.num_evictions += len(dropped)
            self._free_slots = [s for s in self._free_slots if s < new]
            self.num_slots = new
            return dropped
