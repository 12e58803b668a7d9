"""The free-block queue: a doubly linked list of blocks with ref_cnt 0, in eviction order."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from kvtierd.index.kv_block import KVBlock


class FreeBlockQueue:
    """Blocks with ref_cnt 0 in eviction order: head = next victim.

    The order is the block index's policy (BlockIndex.free): blocks that hold no hash go to the
    head, so they are reused first, cached blocks to the tail, least recently released first.

    Pop-head, append-tail, push-head and remove-from-middle are O(1): a prefix hit takes a cached
    block out of the middle, which a deque or a heap cannot do in constant time. Sentinel blocks
    at both ends mean every queued block has both links set and no operation special-cases the
    ends (the asserts `is not None` below state it where a link is followed). Not thread-safe:
    the owner (BlockIndex) holds its lock around every call.
    """

    def __init__(self, blocks: Iterable[KVBlock] = ()) -> None:
        self._head = KVBlock(block_id=-1)
        self._tail = KVBlock(block_id=-2)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self.num_free_blocks

    def popleft(self) -> KVBlock:
        """Take the head (the next victim). The caller checks emptiness first."""
        block = self._head.next_free
        assert block is not None and block is not self._tail, "pop from an empty free queue"
        self.remove(block)
        return block

    def peekleft(self) -> KVBlock | None:
        block = self._head.next_free
        return None if block is self._tail else block

    def append(self, block: KVBlock) -> None:
        """Put a just-released block at the tail: it is evicted last."""
        assert block.prev_free is None and block.next_free is None, f"block {block.block_id} already queued"
        last = self._tail.prev_free
        assert last is not None
        block.prev_free, block.next_free = last, self._tail
        last.next_free = block
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def extend(self, blocks: list[KVBlock]) -> None:
        """Append blocks at the tail in order, linking them in one pass."""
        last = self._tail.prev_free
        assert last is not None
        for block in blocks:
            assert block.prev_free is None, f"block {block.block_id} already queued"
            block.prev_free = last
            last.next_free = block
            last = block
        last.next_free = self._tail
        self._tail.prev_free = last
        self.num_free_blocks += len(blocks)

    def prepend_many(self, blocks: list[KVBlock]) -> None:
        """Put blocks at the head in order (the first is the next victim), linking them in one pass."""
        if not blocks:
            return
        first = self._head.next_free
        assert first is not None
        previous = self._head
        for block in blocks:
            assert block.prev_free is None, f"block {block.block_id} already queued"
            block.prev_free = previous
            previous.next_free = block
            previous = block
        previous.next_free = first
        first.prev_free = previous
        self.num_free_blocks += len(blocks)

    def popleft_many(self, num_blocks: int) -> list[KVBlock]:
        """Take `num_blocks` from the head, in order, unlinking them in one pass."""
        assert 0 <= num_blocks <= self.num_free_blocks, f"pop {num_blocks} of {self.num_free_blocks}"
        taken = []
        block = self._head.next_free
        for _ in range(num_blocks):
            assert block is not None
            taken.append(block)
            following = block.next_free
            block.prev_free = block.next_free = None
            block = following
        assert block is not None
        self._head.next_free = block
        block.prev_free = self._head
        self.num_free_blocks -= num_blocks
        return taken

    def appendleft(self, block: KVBlock) -> None:
        """Put a block at the head: it is the next victim (used for blocks that hold nothing)."""
        assert block.prev_free is None and block.next_free is None, f"block {block.block_id} already queued"
        first = self._head.next_free
        assert first is not None
        block.prev_free, block.next_free = self._head, first
        first.prev_free = block
        self._head.next_free = block
        self.num_free_blocks += 1

    def remove(self, block: KVBlock) -> None:
        """Unlink a block from anywhere in the queue."""
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None, f"block {block.block_id} is not queued"
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def remove_many(self, blocks: list[KVBlock]) -> None:
        """Unlink several blocks from anywhere in the queue."""
        for block in blocks:
            prev, nxt = block.prev_free, block.next_free
            assert prev is not None and nxt is not None, f"block {block.block_id} is not queued"
            prev.next_free = nxt
            nxt.prev_free = prev
            block.prev_free = block.next_free = None
        self.num_free_blocks -= len(blocks)

    def __iter__(self) -> Iterator[KVBlock]:
        """Head to tail."""
        block = self._head.next_free
        while block is not self._tail:
            assert block is not None
            yield block
            block = block.next_free
