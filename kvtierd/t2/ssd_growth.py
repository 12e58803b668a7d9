"""How far a layout's SSD slot files extend, against the node's disk budget (node_budget.py,
shared by every layout's tier): they grow as blocks are written and give their end back when
another layout needs the disk.

Growth comes in chunks the budget grants (a chunk at a time while the tier is below its fair
share), never past the tier's capacity; a tier below its fair share first asks the tier furthest
above its share to give back. Giving back evicts the tier's least recently used blocks wherever
they lie, moves the blocks it keeps out of the end of the files (a disk copy, ssd_moves.py), and
truncates the files, in an order that a crash at any instant leaves every LMDB record naming a slot
that holds exactly its block (`shed`). The extent changes only under the tier's write lock; while a
give-back moves blocks (without the lock) the files do not grow.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Sequence

from kvtierd.index.extent_slot_index import ExtentSlotIndex
from kvtierd.index.slot_entry import SlotEntry
from kvtierd.t2.node_budget import NodeBudget
from kvtierd.t2.ssd_config import SsdTierConfig
from kvtierd.t2.ssd_files import SlotFiles
from kvtierd.t2.ssd_index import Record
from kvtierd.t2.ssd_moves import MoveOutcome, SlotMover

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


@dataclasses.dataclass(frozen=True, slots=True)
class TierCalls:
    """What the growth calls in its tier (ssd_tier.py), each under the tier's write lock."""

    commit_index: Callable[..., bool]  # one LMDB transaction (deletes=, puts=); False: failed, deletes pending
    stop_admitting: Callable[[BaseException, str], None]  # the disk failed (growth, a give-back's writes)
    record: Callable[[SlotEntry, int, int], Record]  # a block's record with (checksum, global slot)
    count_lost: Callable[[Sequence[str]], None]  # blocks lost to failed reads ("io" or "corrupt" each)


class SsdGrowth:
    """Grows and shrinks one tier's extent: its slot files and its slot index together, with the
    bytes taken from or given back to the budget. `write_lock` is the tier's (see ssd_tier.py).

    Invariants: outside `shed`, the files hold exactly the index's extent and the budget holds
    `extent * stride` for `key`; while a shed moves blocks (`_shedding`), nothing grows the extent,
    so the slots past the new end keep their bytes until the records naming them are gone."""

    def __init__(self, budget: NodeBudget, key: str, files: SlotFiles, index: ExtentSlotIndex,
                 write_lock: threading.Lock, mover: SlotMover, tier: TierCalls) -> None:
        self.budget, self.key = budget, key
        self.stride = files.stride
        self._files, self._index, self._mover, self._tier = files, index, mover, tier
        self._write_lock = write_lock
        self._shedding = False  # under write_lock: a shed is moving blocks
        self._grow_slots = max(1, GROW_CHUNK_BYTES // self.stride)

    def watermark_victims(self, config: SsdTierConfig) -> list[SlotEntry]:
        """After a store (under `write_lock`): above `config.high_watermark` of the most slots the tier may
        hold used, the least recently used entries evicted down to `config.low_watermark`, for the caller
        to delete."""
        num_slots, num_used = self._index.max_slots, self._index.num_used_slots
        if num_used <= int(config.high_watermark * num_slots):
            return []
        return self._index.evict_lru(num_used - int(config.low_watermark * num_slots))

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
            if num_missing <= 0 or self._shedding:  # a give-back in flight: reuse this tier's own slots
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
                self._tier.stop_admitting(error, "slot file growth")
                return
            index.grow(num_granted)

    def _num_wanted(self, num_missing: int) -> int:
        """Slots to grow by for `num_missing`: a chunk while under the fair share, else what is missing."""
        share = self.budget.share(self.key)
        num_below_share = max(0, share.share_bytes - share.held_bytes) // self.stride
        num_slots_left = self._index.max_slots - self._index.num_slots
        return min(max(num_missing, min(self._grow_slots, num_below_share)), num_slots_left)

    def shed(self, nbytes: int) -> int:
        """Give back at least `nbytes` of disk to the budget (another layout needs it): evict this
        tier's least recently used blocks wherever they lie, move the kept ones out of the end of
        the files, truncate them. Returns the bytes given back (fewer when stores or loads hold
        slots near the end). The caller keeps the tier open meanwhile. In this order:
          1. under the write lock: plan (the index's extent is cut at once, the moving blocks are
             invisible and their new slots reserved), and one LMDB commit deletes the evicted
             blocks' records before any of their slots is written;
          2. without it: the kept blocks past the end are read (verified), written at their new
             slots and synced per the durability, their records still naming the old slots;
          3. under it: one LMDB commit puts the moved blocks' records with their new slots and
             deletes those that could not move; the index shows them at the new slots;
          4. the files are truncated to the new extent; the budget gets the bytes back."""
        with self._write_lock:
            assert not self._shedding, "NodeBudget sheds a holder once at a time"
            extent = self._index.num_slots
            shrink = self._index.plan_shrink(extent - -(-nbytes // self.stride))
            if shrink.new_num_slots == extent:
                return 0
            self._shedding = True
            deleted = self._tier.commit_index("give back disk", deletes=[e.block_hash for e in shrink.evicted])
        outcome = None
        try:
            if deleted:  # else an evicted block's record may remain: none of their slots is written
                outcome = self._mover.move(shrink.moves)
        finally:
            with self._write_lock:
                landed = self._commit_moves(shrink.moves, outcome)
                self._index.finish_shrink(shrink, landed)
                try:
                    self._files.resize(shrink.new_num_slots)
                except OSError as error:
                    log.error("SSD tier: truncating the slot files failed: %s", error)
                self._shedding = False
                released = (extent - shrink.new_num_slots) * self.stride
                self.budget.release(self.key, released)
        log.info("SSD tier %s: gave back %d bytes of disk to another layout (%d blocks evicted, %d moved, %d lost)",
                 self.key, released, len(shrink.evicted), sum(landed), len(landed) - sum(landed))
        return released

    def _commit_moves(self, moves: list[tuple[SlotEntry, int, int]], outcome: MoveOutcome | None) -> list[bool]:
        """Step 3 of `shed` (under the write lock): the records of the blocks that moved name their
        new slots, those of the others go; which moves landed (all failed without `outcome`)."""
        if outcome is None:
            outcome = MoveOutcome(["index"] * len(moves), [0] * len(moves), None)
        if outcome.write_error is not None:
            self._tier.stop_admitting(outcome.write_error, "give back disk: moving blocks")
        results = outcome.results
        self._tier.count_lost([why for why in results if why in ("io", "corrupt")])
        puts = [self._tier.record(entry, checksum, new)
                for (entry, _, new), why, checksum in zip(moves, results, outcome.checksums) if why is True]
        deletes = [entry.block_hash for (entry, _, _), why in zip(moves, results) if why is not True]
        committed = self._tier.commit_index("give back disk", deletes=deletes, puts=puts)
        return [why is True and committed for why in results]
