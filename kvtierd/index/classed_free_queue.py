"""The device pool's free blocks in eviction order: one free queue per retention class; class NONE's
cached blocks in T0's eviction order (eviction_order.py) where that is not LRU."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator

from kvtierd.daemon_key import DaemonKey
from kvtierd.index.eviction_order import EvictionOrder, make_eviction_order
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
    which class holds it.

    Class NONE's order is T0's eviction policy (`set_eviction`). LRU: one linked list, the blocks
    that hold nothing at its head. Another order (S3-FIFO): the blocks that hold nothing stay in the
    linked list, ahead of every cached block (reused first, as always), and class NONE's cached
    blocks are that order's keys (its ghost remembers their hashes); a lapsed block is its next
    victim. Such an order counts a block's return (`append`) after it left for a hit as a use, so a
    block that drops its hash (`appendleft`, `prepend_many`) is forgotten there. Not thread-safe:
    BlockIndex holds its lock around every call.
    """

    def __init__(self, blocks: Iterable[KVBlock] = ()) -> None:
        self._queues = [FreeBlockQueue() for _ in range(NUM_CLASSES)]
        self._queues[0].extend(list(blocks))
        self.retention: TierRetention | None = None  # set once, before any hint (BlockCache.set_retention)
        self._cached: EvictionOrder[KVBlock] | None = None  # class NONE's cached blocks; None: LRU, in _queues[0]
        self._retained: dict[DaemonKey, list[KVBlock]] = {}  # the queued blocks above class NONE, by key

    def set_retention(self, retention: TierRetention) -> None:
        """Evict by retention class over `retention` from now on; set once, before any hint."""
        self.retention = retention
        retention.downgrade = self._downgrade

    def _downgrade(self, key: DaemonKey) -> None:
        """TierRetention gives the room of a retained block of `key` to a stronger hint: one such
        block to class NONE, as its most recently used (its hint still lives)."""
        block = self._retained[key][-1]
        self._unlink(block, block.retention_class)
        self._leave(block)
        if self._cached is not None:
            self._cached.insert(block)
        else:
            self._queues[0].append(block)

    def set_eviction(self, name: str) -> None:
        """Class NONE's cached blocks in the order called `name` (eviction_order.py); set once,
        before any block is cached."""
        assert all(block.block_hash is None for block in self), "set before any block is cached"
        self._cached = None if name == "lru" else make_eviction_order(name, _block_hash)

    @property
    def num_free_blocks(self) -> int:
        return sum(queue.num_free_blocks for queue in self._queues) + len(self._cached or ())

    def __len__(self) -> int:
        return self.num_free_blocks

    def __iter__(self) -> Iterator[KVBlock]:
        """Next victim first."""
        return itertools.chain(self._queues[0], self._cached or (), *self._queues[1:])

    def peekleft(self) -> KVBlock | None:
        self._settle_heads()
        return next(iter(self), None)

    # ----------------------------------------------------------------------------- joining

    def append(self, block: KVBlock) -> None:
        """A released block at the tail of its class (in class NONE: as T0's order takes it)."""
        priority = self._enter(block)
        if priority is Priority.NONE and self._cached is not None and block.block_hash is not None:
            self._cached.insert(block)
        else:
            self._queues[priority].append(block)

    def extend(self, blocks: list[KVBlock]) -> None:
        if not self._hinted() and self._cached is None:
            self._queues[0].extend(blocks)
            return
        for block in blocks:
            self.append(block)

    def appendleft(self, block: KVBlock) -> None:
        """A block that holds nothing, at the head: the next victim."""
        assert block.block_hash is None, "a cached block joins at its class's tail"
        self._queues[0].appendleft(block)
        if self._cached is not None:
            self._cached.discard(block)

    def prepend_many(self, blocks: list[KVBlock]) -> None:
        self._queues[0].prepend_many(blocks)
        if self._cached is not None:
            for block in blocks:
                self._cached.discard(block)

    # ----------------------------------------------------------------------------- leaving

    def popleft(self) -> KVBlock:
        block, = self.popleft_many(1)
        return block

    def popleft_many(self, num_blocks: int) -> list[KVBlock]:
        """The next `num_blocks` victims, in order, from the lowest classes."""
        assert 0 <= num_blocks <= self.num_free_blocks, f"pop {num_blocks} of {self.num_free_blocks}"
        first, cached = self._queues[0], self._cached
        if first.num_free_blocks + len(cached or ()) < self.num_free_blocks:  # some are retained: lapsed heads go first
            self._settle_heads()
        if num_blocks <= first.num_free_blocks:
            return first.popleft_many(num_blocks)
        taken = first.popleft_many(first.num_free_blocks)
        while cached and len(taken) < num_blocks:
            taken.append(cached.pop())
        for queue in self._queues[1:]:
            part = queue.popleft_many(min(num_blocks - len(taken), queue.num_free_blocks))
            for block in part:
                self._leave(block)
            taken += part
        return taken

    def remove(self, block: KVBlock) -> None:
        self._unlink(block, block.retention_class)
        self._leave(block)

    def remove_many(self, blocks: list[KVBlock]) -> None:
        for block in blocks:
            self.remove(block)

    def declassify_all(self) -> None:
        """Every block back to class NONE (before the pool forgets every hash: BlockCache.reset); under
        an order other than LRU, its blocks join the ones that hold nothing, forgotten there."""
        if self._cached is not None:
            blocks = list(self._cached)
            for block in blocks:
                self._cached.discard(block)
            self._queues[0].extend(blocks)
        for queue in self._queues[1:]:
            blocks = queue.popleft_many(queue.num_free_blocks)
            for block in blocks:
                self._leave(block)
            self._queues[0].extend(blocks)

    # ----------------------------------------------------------------------------- hints changed

    def reclassify(self, blocks: Iterable[KVBlock]) -> None:
        """The hints of these blocks' keys (a chain's, head first) changed: move the queued ones to
        their class now. The classes are taken head first (a quota short of the chain retains its
        head), the queues entered tail first (the chain's tail leaves its class first)."""
        if self.retention is None:
            return
        cached = self._cached
        moves = [move for block in blocks if block.is_queued or (cached is not None and block in cached)
                 if (move := self._change_class(block)) is not None]
        for block, old, new in reversed(moves):
            self._move(block, old, new)

    def _reclassify(self, block: KVBlock) -> None:
        if (move := self._change_class(block)) is not None:
            self._move(*move)

    def _change_class(self, block: KVBlock) -> tuple[KVBlock, Priority, Priority] | None:
        """The block's class anew (its hint, within the quota): (block, old, new), or None when it
        stays where it is."""
        old = block.retention_class
        self._leave(block)
        new = self._enter(block)
        cached = self._cached
        if new is old and cached is not None and block in cached:
            return None  # still in T0's order: it keeps its place and history there
        return block, old, new

    def _move(self, block: KVBlock, old: Priority, new: Priority) -> None:
        """From the queue of class `old` to that of `new`."""
        self._unlink(block, old)
        if new is Priority.NONE and old is not Priority.NONE:  # lapsed: the next victim
            cached = self._cached
            if cached is not None:
                cached.insert_first(block)
            else:
                self._queues[0].appendleft(block)
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
            if priority is not Priority.NONE:
                self._retained.setdefault(key, []).append(block)
        block.retention_class = priority
        return priority

    def _unlink(self, block: KVBlock, priority: Priority) -> None:
        """Out of the queue of class `priority` (class NONE's cached blocks: out of T0's order)."""
        if priority is Priority.NONE and self._cached is not None and block in self._cached:
            self._cached.remove(block)
        else:
            self._queues[priority].remove(block)

    def _leave(self, block: KVBlock) -> None:
        priority, key = block.retention_class, block.block_hash
        if priority is not Priority.NONE:
            assert self.retention is not None and key is not None
            blocks = self._retained[key]
            blocks.remove(block)
            if not blocks:
                del self._retained[key]
            block.retention_class = Priority.NONE
            self.retention.leave(key, priority)


def _block_hash(block: KVBlock) -> DaemonKey | None:
    """What S3-FIFO's ghost remembers of an evicted block: its content (the block itself is reused)."""
    return block.block_hash
