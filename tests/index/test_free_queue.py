"""The free queue: O(1) pop-head, append-tail, push-head and remove-from-middle, in order."""

from __future__ import annotations

from kvtierd.index.free_queue import FreeBlockQueue
from kvtierd.index.kv_block import KVBlock


def ids(queue: FreeBlockQueue) -> list[int]:
    return [block.block_id for block in queue]


def make_queue(n: int = 5) -> tuple[FreeBlockQueue, list[KVBlock]]:
    blocks = [KVBlock(i) for i in range(n)]
    return FreeBlockQueue(blocks), blocks


def test_initial_order_is_head_to_tail():
    queue, blocks = make_queue()
    assert ids(queue) == [0, 1, 2, 3, 4]
    assert len(queue) == 5 and all(block.is_queued for block in blocks)


def test_popleft_takes_the_head():
    queue, _ = make_queue()
    block = queue.popleft()
    assert block.block_id == 0 and not block.is_queued
    assert ids(queue) == [1, 2, 3, 4] and len(queue) == 4


def test_remove_from_the_middle_and_append_at_the_tail():
    queue, blocks = make_queue()
    queue.remove(blocks[2])
    assert ids(queue) == [0, 1, 3, 4] and not blocks[2].is_queued
    queue.append(blocks[2])
    assert ids(queue) == [0, 1, 3, 4, 2]


def test_appendleft_makes_the_next_victim():
    queue, blocks = make_queue()
    queue.remove(blocks[4])
    queue.appendleft(blocks[4])
    assert queue.popleft() is blocks[4]


def test_remove_the_ends_and_empty_the_queue():
    queue, blocks = make_queue(3)
    queue.remove(blocks[0])
    queue.remove(blocks[2])
    assert ids(queue) == [1] and queue.peekleft() is blocks[1]
    queue.popleft()
    assert len(queue) == 0 and ids(queue) == [] and queue.peekleft() is None
    queue.append(blocks[0])
    assert ids(queue) == [0]


def test_links_stay_consistent_after_mixed_operations():
    queue, blocks = make_queue(6)
    queue.remove(blocks[3])
    queue.popleft()
    queue.append(blocks[3])
    queue.appendleft(queue.popleft())
    order = list(queue)
    for prev, nxt in zip(order, order[1:]):
        assert prev.next_free is nxt and nxt.prev_free is prev
    assert ids(queue) == [1, 2, 4, 5, 3]


def test_popleft_many_and_extend_keep_order_and_links():
    queue, blocks = make_queue(6)
    taken = queue.popleft_many(4)
    assert [b.block_id for b in taken] == [0, 1, 2, 3] and ids(queue) == [4, 5]
    assert not any(b.is_queued for b in taken)
    queue.extend(list(reversed(taken)))
    assert ids(queue) == [4, 5, 3, 2, 1, 0] and len(queue) == 6
    assert queue.popleft_many(0) == [] and queue.popleft_many(6) == blocks[4:] + blocks[3::-1]
    assert len(queue) == 0 and queue.peekleft() is None
    queue.extend([])
    queue.extend(blocks[:2])
    assert ids(queue) == [0, 1]


def test_remove_many_unlinks_from_anywhere():
    queue, blocks = make_queue(6)
    queue.remove_many([blocks[0], blocks[3], blocks[5]])
    assert ids(queue) == [1, 2, 4] and len(queue) == 3
    assert not any(blocks[i].is_queued for i in (0, 3, 5))
    queue.remove_many([])
    assert ids(queue) == [1, 2, 4]


def test_prepend_many_puts_the_blocks_at_the_head_in_their_order():
    queue, blocks = make_queue(5)
    taken = queue.popleft_many(3)
    queue.prepend_many([taken[2], taken[0]])
    assert ids(queue) == [2, 0, 3, 4] and len(queue) == 4
    queue.prepend_many([])
    assert ids(queue) == [2, 0, 3, 4]
    assert queue.popleft() is blocks[2]
