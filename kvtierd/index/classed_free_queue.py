"""The device pool's free blocks in eviction order: one free queue per retention class."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator

from kvtierd.daemon_key import DaemonKey
from kvtierd.index.free_queue import FreeBlockQueue
from kvtierd.index.kv_block import KVBlock
from kvtierd.retention.hint import NUM_CLASSES, Priority
from kvtierd.retention.tier_retention import TierRetention


class ClassedFreeQueue:
    """FreeBlockQueue's surface over one FreeBlockQueue per retention class: the head (next victim)
    is the head of the lowest class that has blocks — blocks without a live hint first (empty ones
    among them), then LOW, NORMAL, HIGH — and each class keeps BlockIndex.free's order.

    A cached block's class is decided when it joins (`append`, `extend`: TierRetention.enter) and
    again by `reclassify`; the blocks joining at the head hold nothing (class NONE). A retained
    class's head whose hint lapsed is moved down when reached (lazily); a lapsed block goes to the
    head of class NONE (it stayed past its natural eviction). Without `retention`, or while no hint
    lives, every block is in class NONE: exactly one FreeBlockQueue. `block.retention_class` says
    which queue holds it. Not thread-safe: BlockIndex holds its lock around every call.
    """

    def __init__(self, blocks: Iterable[KVBlock] = ()) -> None:
        self._queues = [FreeBlockQueue() for _ in range(NUM_CLASSES)]
        self._queues[0].extend(list(blocks))
        self.retention: TierRetention | None = None  # set once, before any hint (BlockCache.set_retention)

    @property
    def num_free_blocks(self) -> int:
        return sum(queue.num_free_blocks for queue in self._queues)

    def __len__(self) -> int:
        return self.num_free_blocks

    def __iter__(self) -> Iterator[KVBlock]:
        """Next victim first."""
        return itertools.chain.from_iterable(self._queues)

    def peekleft(self) -> KVBlock | None:
        self._settle_heads()
        return next(iter(self), None)

    # ----------------------------------------------------------------------------- joining

    def append(self, block: KVBlock) -> None:
        """A released block at the tail of its class."""
        self._queues[self._enter(block)].append(block)

    def extend(self, blocks: list[KVBlock]) -> None:
        if not self._hinted():
            self._queues[0].extend(blocks)
            return
        for block in blocks:
            self.append(block)

    def appendleft(self, block: KVBlock) -> None:
        """A block that holds nothing, at the head: the next victim."""
        assert block.block_hash is None, "a cached block joins at its class's tail"
        self._queues[0].appendleft(block)

    def prepend_many(self, blocks: list[KVBlock]) -> None:
        self._queues[0].prepend_many(blocks)

    # ----------------------------------------------------------------------------- leaving

    def popleft(self) -> KVBlock:
        block, = self.popleft_many(1)
        return block

    def popleft_many(self, num_blocks: int) -> list[KVBlock]:
        """The next `num_blocks` victims, in order, from the lowest classes."""
        assert 0 <= num_blocks <= self.num_free_blocks, f"pop {num_blocks} of {self.num_free_blocks}"
        first = self._queues[0]
        if first.num_free_blocks < self.num_free_blocks:  # some are retained: lapsed heads go first
            self._settle_heads()
        if num_blocks <= first.num_free_blocks:
            return first.popleft_many(num_blocks)
        taken: list[KVBlock] = []
        for queue in self._queues:
            part = queue.popleft_many(min(num_blocks - len(taken), queue.num_free_blocks))
            for block in part:
                self._leave(block)
            taken += part
        return taken

    def remove(self, block: KVBlock) -> None:
        self._queues[block.retention_class].remove(block)
        self._leave(block)

    def remove_many(self, blocks: list[KVBlock]) -> None:
        for block in blocks:
            self.remove(block)

    def declassify_all(self) -> None:
        """Every block back to class NONE (before the pool forgets every hash: BlockCache.reset)."""
        for queue in self._queues[1:]:
            blocks = queue.popleft_many(queue.num_free_blocks)
            for block in blocks:
                self._leave(block)
            self._queues[0].extend(blocks)

    # ----------------------------------------------------------------------------- hints changed

    def reclassify(self, blocks: Iterable[KVBlock]) -> None:
        """The hints of these blocks' keys changed: move the queued ones to their class now."""
        if self.retention is None:
            return
        for block in blocks:
            if block.is_queued:
                self._reclassify(block)

    def _reclassify(self, block: KVBlock) -> None:
        old = block.retention_class
        self._queues[old].remove(block)
        self._leave(block)
        new = self._enter(block)
        if new is Priority.NONE and old is not Priority.NONE:
            self._queues[0].appendleft(block)  # lapsed: the next victim
        else:
            self._queues[new].append(block)

    def _settle_heads(self) -> None:
        retention = self.retention
        if retention is None:
            return
        now = retention.table.now()
        for priority in range(NUM_CLASSES - 1, 0, -1):
            queue = self._queues[priority]
            while (block := queue.peekleft()) is not None:
                assert block.block_hash is not None, "a retained block holds its hash"
                if retention.table.priority(block.block_hash, now) >= priority:
                    break
                self._reclassify(block)

    # ----------------------------------------------------------------------------- classes

    def _hinted(self) -> bool:
        return self.retention is not None and len(self.retention.table) > 0

    def _enter(self, block: KVBlock) -> Priority:
        key: DaemonKey | None = block.block_hash
        priority = Priority.NONE
        if key is not None and self._hinted():
            assert self.retention is not None
            priority = self.retention.enter(key)
        block.retention_class = priority
        return priority

    def _leave(self, block: KVBlock) -> None:
        if block.retention_class is not Priority.NONE:
            assert self.retention is not None and block.block_hash is not None
            self.retention.leave(block.block_hash, block.retention_class)
            block.retention_class = Priority.NONE
