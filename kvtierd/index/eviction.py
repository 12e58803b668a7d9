"""Eviction in the device tier: which free block is reused next, and what the tiers hear of it.

The head of the free queue is the victim; BlockIndex.free keeps the order (blocks that hold no
hash first, then cached blocks, least recently released first). A victim that still holds a hash
is unindexed; when it was the last copy of its hash, the hash leaves T0: the eviction hook sees
the block with its content intact (the tiers may copy it down) and BlockRemoved is queued. A copy
whose hash another block still holds leaves silently: T0 keeps serving that hash.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from kvtierd.index.classed_free_queue import ClassedFreeQueue
from kvtierd.index.hash_to_blocks import HashToBlocks
from kvtierd.index.index_events import BlockRemoved, EventQueue
from kvtierd.index.index_metrics import IndexObserver
from kvtierd.index.kv_block import KVBlock
from kvtierd.index.residency import LeaveReason, Residency

log = logging.getLogger(__name__)

EvictionHook = Callable[[list[KVBlock]], None]  # sees the victims whose hash leaves T0, content intact


class Evictor:
    """Pops victims off the free queue for reuse and drops their hashes.

    Called only by BlockIndex, under its lock; `on_evict` is set once, before use (the tier
    manager offloads through it), and runs under that lock.
    """

    def __init__(self, free_queue: ClassedFreeQueue, hash_to_blocks: HashToBlocks, on_evict: EvictionHook | None,
                 observer: IndexObserver | None, events: EventQueue | None) -> None:
        self.free_queue = free_queue
        self.hash_to_blocks = hash_to_blocks
        self.on_evict = on_evict
        self.num_evictions = 0  # blocks whose hash was dropped to reuse them (every copy counts)
        self.residency = Residency()  # commit to eviction, by why each left (residency.py); every copy counts
        self._observer = observer
        self._events = events

    def pop_free(self, num_blocks: int, now: float) -> list[KVBlock]:
        """Take the next victims from the head, each with ref_cnt 1; cached ones are evicted first."""
        blocks = self.free_queue.popleft_many(num_blocks)
        victims = [block for block in blocks if block.block_hash is not None]
        if victims:
            self.evict(victims, now)
        for block in blocks:
            assert block.ref_cnt == 0, f"block {block.block_id} on the free queue with ref_cnt {block.ref_cnt}"
            block.ref_cnt = 1
        return blocks

    def evict(self, victims: list[KVBlock], now: float, copy_down: bool = True,
              reason: LeaveReason | None = None) -> int:
        """Drop cached blocks' content keys: unindex the copies, tell the tiers about the hashes
        that leave with them (they may copy them down; not when `copy_down` is false), then
        forget. Each one's residency is recorded as `reason` (None: the tier's classify says).
        Returns how many hashes left."""
        self.num_evictions += len(victims)
        leaving = self.hash_to_blocks.remove_many(victims)  # each the last copy of its hash
        if self.on_evict is not None and leaving and copy_down:
            try:
                self.on_evict(leaving)
            except Exception:  # an offload failure must not corrupt the index; the blocks are lost below
                log.exception("eviction hook failed for %d blocks", len(leaving))
        left = self.residency.left
        for block in victims:
            assert block.block_hash is not None, "a victim holds its hash until forgotten below"
            left(block.block_hash, now - block.committed_at_s, reason)
        if self._observer is not None:
            self._observer.on_evict([now - block.committed_at_s for block in victims],
                                    [now - block.released_at_s for block in victims])
        if self._events is not None:
            for block in leaving:
                assert block.block_hash is not None, "a victim holds its hash until forgotten below"
                self._events.put(BlockRemoved(block.block_hash))
        for block in victims:
            block.block_hash = block.parent_hash = block.token_ids = None  # as KVBlock.forget_content
        return len(leaving)

    def evict_free(self, blocks: list[KVBlock], now: float, copy_down: bool) -> int:
        """The operator's evict of cached blocks nobody holds: drop their content now (copied down
        first when `copy_down`) and move them to the head of the free queue, reused first.
        Returns how many hashes left."""
        assert all(block.ref_cnt == 0 for block in blocks)
        self.free_queue.remove_many(blocks)  # while they hold their keys (their retention class counts them)
        num_left = self.evict(blocks, now, copy_down, LeaveReason.FLUSHED)
        for block in blocks:
            self.free_queue.appendleft(block)
        return num_left
