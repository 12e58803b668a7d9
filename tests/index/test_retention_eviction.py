"""Eviction by retention class in T0's free queue and a lower tier's slot index: unretained blocks
first, then LOW, NORMAL, HIGH, LRU within each; lapsed hints rejoin at the head; quotas downgrade."""

from __future__ import annotations

from kvtierd.daemon_key import DaemonKey, tenant_tag_of
from kvtierd.index.slot_entry import BlockMeta
from kvtierd.index.slot_index import SlotIndex
from kvtierd.retention.hint import Priority
from kvtierd.retention.hint_table import HintTable
from kvtierd.retention.tier_retention import TierRetention
from kvtierd.tier import Tier
from kvtierd.token_bytes import NO_TOKENS
from tests.factories import BLOCK_SIZE, FakeClock, make_index, run_request, tokens


def retained_index(num_blocks: int, clock: FakeClock, limit: int = 1000):
    table = HintTable(clock)
    index = make_index(num_blocks, clock=clock)
    index.set_retention(TierRetention(Tier.T0, table, lambda: limit))
    table.add_listener(index.reclassify)
    return index, table


def cached_chains(index, num_chains: int) -> list[list[DaemonKey]]:
    """`num_chains` one-block chains, cached and released in order (the first is least recently used)."""
    chains = []
    for i in range(num_chains):
        allocation = run_request(index, f"r{i}", tokens(1000 * (i + 1), 4))
        block_hash = index.blocks[allocation.block_ids[0]].block_hash
        assert block_hash is not None
        chains.append([block_hash])
        index.free(f"r{i}")
    return chains


def evicted_order(index, num_blocks: int) -> list[DaemonKey | None]:
    """The hashes the next `num_blocks` fresh blocks evict, in order (as the eviction hook sees them)."""
    victims: list[DaemonKey | None] = []
    index.on_evict = lambda blocks: victims.extend(block.block_hash for block in blocks)
    index.allocate("fresh", [], num_blocks)
    return victims


def test_t0_evicts_unretained_then_low_normal_high_lru_within_each():
    clock = FakeClock()
    index, table = retained_index(6, clock)
    (a,), (b,), (c,), (d,), (e,), (f,) = cached_chains(index, 6)
    table.set([a], "s", Priority.HIGH, 60)
    table.set([b], "s", Priority.LOW, 60)  # one chain per hint: a chain's blocks enter their class tail first
    table.set([e], "s", Priority.LOW, 60)
    table.set([c], "s", Priority.NORMAL, 60)
    assert evicted_order(index, 6) == [d, f, b, e, c, a]


def test_t0_without_hints_is_plain_lru():
    clock = FakeClock()
    index, _ = retained_index(4, clock)
    chains = cached_chains(index, 4)
    assert evicted_order(index, 4) == [chain[0] for chain in chains]


def test_a_lapsed_hint_is_evicted_first_even_before_the_sweep():
    clock = FakeClock()
    index, table = retained_index(4, clock)
    (a,), (b,), (c,), (d,) = cached_chains(index, 4)
    table.set([a], "s", Priority.HIGH, 10)
    table.set([b], "s", Priority.HIGH, 100)
    clock.advance(11)
    assert evicted_order(index, 1) == [a]  # the lapsed head moved down when reached, to the head
    assert table.expire() == 1
    assert [blk.block_hash for blk in index.free_queue] == [c, d, b]


def test_a_block_in_use_is_never_evicted_and_rejoins_its_class_when_released():
    clock = FakeClock()
    index, table = retained_index(3, clock)
    (a,), (b,), (c,) = cached_chains(index, 3)
    table.set([a], "s", Priority.HIGH, 60)
    index.allocate("reader", [a], 0)
    assert [blk.block_hash for blk in index.free_queue] == [b, c]
    index.free("reader")
    assert [blk.block_hash for blk in index.free_queue] == [b, c, a]


def meta(i: int) -> BlockMeta:
    key = DaemonKey(b"t" * 16 + bytes([i]) * 32)
    return BlockMeta(key, key, NO_TOKENS)


def store(index: SlotIndex, metas: list[BlockMeta]) -> list:
    plan = index.prepare_store(metas)
    index.complete_store(plan.stores, success=True)
    return plan.evicted


def test_a_slot_index_evicts_by_class_then_lru_and_a_release_returns_the_order():
    clock = FakeClock()
    table = HintTable(clock)
    index = SlotIndex(4)
    index.set_retention(TierRetention(Tier.T1, table, lambda: 1000))
    table.add_listener(index.reclassify)
    store(index, [meta(i) for i in range(4)])
    table.set([meta(0).block_hash], "s", Priority.HIGH, 60)
    table.set([meta(1).block_hash], "s", Priority.LOW, 60)
    evicted = store(index, [meta(i) for i in range(10, 14)])
    assert [e.block_hash for e in evicted] == [meta(i).block_hash for i in (2, 3, 1, 0)]
    table.set([meta(10).block_hash], "s", Priority.NORMAL, 60)
    table.release(tenant_tag_of(meta(10).block_hash), "s")
    assert meta(10).block_hash in index
    clock.advance(61)
    evicted = store(index, [meta(20)])
    assert [e.block_hash for e in evicted] == [meta(10).block_hash]  # released: back to plain LRU, oldest


def test_the_tier_quota_downgrades_blocks_past_the_tenants_limit():
    """A limit of 1 retained block per tenant in this tier: the second hinted block evicts as an
    unretained one, counted."""
    table = HintTable(FakeClock())
    index = SlotIndex(3)
    retention = TierRetention(Tier.T1, table, lambda: 1)
    index.set_retention(retention)
    table.add_listener(index.reclassify)
    store(index, [meta(i) for i in range(3)])
    table.set([meta(0).block_hash, meta(1).block_hash], "s", Priority.HIGH, 60)
    assert retention.num_retained_of(tenant_tag_of(meta(0).block_hash)) == 1
    assert retention.num_downgraded_blocks == 1
    evicted = store(index, [meta(i) for i in range(10, 13)])
    assert [e.block_hash for e in evicted] == [meta(i).block_hash for i in (1, 2, 0)]


def test_a_hinted_chain_enters_its_class_tail_first():
    """T0: a hint on a cached 3-block chain moves it into its class tail first, so after the
    unretained d its blocks leave c2, c1, c0 (set head first: the head would go first)."""
    clock = FakeClock()
    index, table = retained_index(4, clock)
    allocation = run_request(index, "c", tokens(0, 3 * BLOCK_SIZE))
    c0, c1, c2 = (index.blocks[block_id].block_hash for block_id in allocation.block_ids)
    index.free("c")
    (d,), = cached_chains(index, 1)
    table.set([c0, c1, c2], "s", Priority.HIGH, 60)
    assert evicted_order(index, 4) == [d, c2, c1, c0]


def test_a_slot_index_takes_a_hinted_chain_into_its_class_tail_first_within_a_short_quota():
    """T1, a quota of 2, four blocks stored apart (LRU 0, 1, 2, 3): a hint on 0, 1, 2 retains 0 and 1
    (the head), which leave their class tail first: 2, 3, then 1, 0."""
    table = HintTable(FakeClock())
    index = SlotIndex(4)
    index.set_retention(TierRetention(Tier.T1, table, lambda: 2))
    table.add_listener(index.reclassify)
    for i in range(4):
        store(index, [meta(i)])
    table.set([meta(i).block_hash for i in range(3)], "s", Priority.HIGH, 60)
    evicted = store(index, [meta(i) for i in range(10, 14)])
    assert [e.block_hash for e in evicted] == [meta(i).block_hash for i in (2, 3, 1, 0)]
