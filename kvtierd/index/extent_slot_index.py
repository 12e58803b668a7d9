"""A slot index over a growing extent: slots `[0, num_slots)` of at most `max_slots` are usable now.

The SSD tier's extent is what its slot files hold: it grows as blocks are written (taking disk from
the node's budget) and shrinks when another layout needs the disk (t2/ssd_growth.py). The host
tier's is the part of its slab backed so far (t1/host_share.py). Both shrink the same way: the least
recently used entries go wherever they lie, and the kept ones past the new end move below it.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

from kvtierd.daemon_key import DaemonKey
from kvtierd.index.slot_entry import SlotEntry
from kvtierd.index.slot_index import SlotIndex


@dataclasses.dataclass(slots=True)
class Shrink:
    """A shrink in two phases (`plan_shrink`, then `finish_shrink` once the bytes moved): the entries
    evicted to make the kept ones fit, and the kept entries past the new extent with the slot each
    moves to (old slot, new slot), invisible until finished."""

    old_num_slots: int
    new_num_slots: int
    evicted: list[SlotEntry]
    moves: list[tuple[SlotEntry, int, int]]  # (entry, its slot now, the slot below the new extent it moves to)


class ExtentSlotIndex(SlotIndex):
    """A SlotIndex whose `num_slots` (the extent) changes: `grow` adds free slots at the end,
    `plan_shrink` / `finish_shrink` give back the end by evicting the least recently used entries
    wherever they are and moving the kept ones below. Invariants of SlotIndex
    hold over the extent; `max_slots` bounds it; an entry being moved holds both its slots (the one
    past the extent until finished) and is invisible meanwhile. New slots are handed out after the
    free slots already there, lowest first, so a layout's blocks stay at the start and a shrink has
    less to move."""

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

    def plan_shrink(self, num_slots: int, grain: int = 1) -> Shrink:
        """Cut the extent to `num_slots` (or to just past the last slot a store or load holds,
        rounded up to a multiple of `grain`): evict least recently used entries until the rest fit
        below it, then reserve a free slot below it for each kept entry past it; those turn
        invisible until `finish_shrink`, after the caller copied their bytes. The new extent is
        `self.num_slots` at once."""
        with self._lock:
            old = self.num_slots
            busy = max((e.slot for e in self._entries.values() if e.storing or e.num_loads), default=-1)
            new = min(old, -(-max(num_slots, busy + 1) // grain) * grain)
            evicted = self._pop_lru(len(self._entries) - new)
            free_below = [s for s in self._free_slots if s < new]
            moves = []
            past_end = [e for e in self._lru.values() if e.slot >= new]  # next victim first (a chain tail first)
            assert len(past_end) == sum(e.slot >= new for e in self._entries.values()), \
                "busy entries lie below the new extent"
            for entry in past_end:
                del self._lru[entry.block_hash]
                entry.storing = True  # invisible and not evictable while its bytes move
                moves.append((entry, entry.slot, free_below.pop()))
            self._free_slots = free_below
            self.num_slots = new
            return Shrink(old, new, evicted, moves)

    def finish_shrink(self, shrink: Shrink, moved: bool | Sequence[bool]) -> None:
        """The moves' bytes landed in their new slots, or did not: `moved` says it for all of them or
        one by one (in `shrink.moves` order). The entries that moved live on there as the most recently
        used, in the eviction order they stood in before (so a chain's blocks still leave tail first);
        one that did not move is dropped (its new slot free)."""
        outcomes = [moved] * len(shrink.moves) if isinstance(moved, bool) else list(moved)
        assert len(outcomes) == len(shrink.moves), (len(outcomes), len(shrink.moves))
        with self._lock:
            for (entry, _, new_slot), landed in zip(shrink.moves, outcomes):
                assert entry.storing and self._entries.get(entry.block_hash) is entry, entry
                entry.storing = False
                if landed:
                    entry.slot = new_slot
                    self._lru[entry.block_hash] = entry
                else:
                    self._delete(entry.block_hash)
                    self._removed(entry)
                    self._free_slots.append(new_slot)
                    self.num_evictions += 1
            if shrink.moves:
                self._room_changed()
