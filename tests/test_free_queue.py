"""The free queue: O(1) pop-head, append-tail, push-head and remove-from-middle, in order."""

from __future__ import annotations

from kvtierd.free_queue import FreeBlockQueue
from kvtierd.kv_block import KVBlock


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
