"""A tenant at its quota of retained blocks in a tier keeps its highest priorities: a stronger hint
takes the room of the weakest retained block (lowest priority, then the hint that runs longest, a
lapsed one first of all), among equal priorities the first retained keep it."""

from __future__ import annotations

from kvtierd.daemon_key import tenant_tag_of
from kvtierd.index.classed_free_queue import ClassedFreeQueue
from kvtierd.index.kv_block import KVBlock
from kvtierd.index.slot_index import SlotIndex
from kvtierd.retention.hint import Priority
from kvtierd.retention.hint_table import HintTable
from kvtierd.retention.tier_retention import TierRetention
from kvtierd.tier import Tier
from tests.factories import FakeClock
from tests.index.test_retention_eviction import meta, store


def slot_index_with_quota(num_slots: int, limit: int) -> tuple[SlotIndex, HintTable, TierRetention, FakeClock]:
    clock = FakeClock()
    table = HintTable(clock)
    index = SlotIndex(num_slots, clock=clock)
    retention = TierRetention(Tier.T1, table, lambda: limit)
    index.set_retention(retention)
    table.add_listener(index.reclassify)
    for i in range(num_slots):
        store(index, [meta(i)])  # one at a time: meta(0) least recently used
    return index, table, retention, clock


def test_a_higher_priority_takes_the_room_of_the_normal_hint_that_runs_longest():
    index, table, retention, _ = slot_index_with_quota(4, limit=2)
    m0, m1, m2, m3 = (meta(i).block_hash for i in range(4))
    table.set([m0], "s", Priority.NORMAL, 60)
    table.set([m1], "s", Priority.NORMAL, 120)
    assert retention.num_downgraded_blocks == 0
    table.set([m2], "s", Priority.HIGH, 60)  # at the quota: m1 (NORMAL, the later expiry) makes room
    assert retention.num_retained_of(tenant_tag_of(m0)) == 2
    assert retention.num_downgraded_blocks == 1
    evicted = store(index, [meta(i) for i in range(10, 14)])
    assert [e.block_hash for e in evicted] == [m3, m1, m0, m2]  # NONE (m1 as its most recent), NORMAL, HIGH


def test_an_equal_priority_at_the_quota_is_downgraded_itself():
    index, table, retention, _ = slot_index_with_quota(4, limit=1)
    m0, m1 = meta(0).block_hash, meta(1).block_hash
    table.set([m0], "s", Priority.NORMAL, 600)
    table.set([m1], "s", Priority.NORMAL, 5)  # sooner, but not stronger: the first retained keeps the room
    assert retention.num_downgraded_blocks == 1
    evicted = store(index, [meta(i) for i in range(10, 14)])
    assert [e.block_hash for e in evicted][-1] == m0


def test_a_lapsed_hint_not_yet_swept_gives_its_room_to_any_live_one():
    index, table, retention, clock = slot_index_with_quota(3, limit=1)
    m0, m1 = meta(0).block_hash, meta(1).block_hash
    table.set([m0], "s", Priority.HIGH, 5)
    clock.advance(10)  # m0's hint lapsed; nothing swept it
    table.set([m1], "s", Priority.LOW, 60)
    assert retention.num_retained_of(tenant_tag_of(m1)) == 1
    evicted = store(index, [meta(i) for i in range(10, 13)])
    assert [e.block_hash for e in evicted][-1] == m1


def free_queue_with_quota(num_blocks: int, limit: int) -> tuple[ClassedFreeQueue, HintTable, list[KVBlock]]:
    """T0's free queue of `num_blocks` cached blocks of one tenant, released in order (0 first)."""
    table = HintTable(FakeClock())
    queue = ClassedFreeQueue()
    queue.set_retention(TierRetention(Tier.T0, table, lambda: limit))
    blocks = [KVBlock(i, block_hash=meta(i).block_hash) for i in range(num_blocks)]
    by_key = {block.block_hash: block for block in blocks}
    table.add_listener(lambda keys: queue.reclassify([by_key[key] for key in keys]))
    queue.extend(blocks)
    return queue, table, blocks


def test_a_low_hint_at_the_quota_takes_nothing_from_a_high_one_in_t0():
    """T0's free queue, quota 1: a HIGH block keeps its room against a LOW hint and against a
    second HIGH one (equal priority); both go to class NONE as its most recent blocks."""
    queue, table, (a, b, c, d) = free_queue_with_quota(4, limit=1)
    table.set([b.block_hash], "s", Priority.HIGH, 60)
    table.set([a.block_hash], "s", Priority.LOW, 60)
    table.set([c.block_hash], "s", Priority.HIGH, 30)
    assert queue.popleft_many(4) == [d, a, c, b]


def test_a_higher_priority_takes_the_room_of_a_lower_one_in_t0():
    queue, table, (a, b, c, d) = free_queue_with_quota(4, limit=1)
    table.set([a.block_hash], "s", Priority.LOW, 60)
    table.set([c.block_hash], "s", Priority.HIGH, 60)  # a goes to class NONE as its most recent block
    assert queue.popleft_many(4) == [b, d, a, c]
    assert queue.retention is not None and queue.retention.num_downgraded_blocks == 1
