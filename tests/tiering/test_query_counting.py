"""A prefix query counts once, where it is asked: a Lookup that names the query counts its blocks,
the hits it promises tier by tier and the ones it declines (misses: recomputed); the Acquire that
loads the promise counts nothing; an Acquire without a Lookup counts the query and its hits."""

from __future__ import annotations

import pytest

from kvtierd.index.index_metrics import IndexStats
from kvtierd.index.query_counting import QueryCounting
from kvtierd.tier import TierCounts
from kvtierd.tiering.tier_config import EdgePolicy, TierConfig
from kvtierd.tiering.tier_manager import TierManager
from tests.factories import BLOCK_SIZE, NAMESPACE, tokens
from tests.tiering.test_tier_manager_costs import CHAIN, FAST_RECOMPUTE_S, PROMPT, SPLIT, t1_then_slow_t2
from tests.tiering.test_tier_manager_ssd import ssd_config
from tests.tiering.tier_factories import LAYOUT, prefill

ASKED = tokens(300, 6 * BLOCK_SIZE)  # PROMPT and two blocks never computed
ASKED_CHAIN = NAMESPACE.hash_blocks(ASKED)


@pytest.fixture
def manager(tmp_path):
    """T0 of 8 blocks, T1 (write-through) and T2, with an index observer (the metrics' counts)."""
    manager = TierManager(LAYOUT, 8, TierConfig(host_capacity_bytes=32 * 4096, t0_to_t1=EdgePolicy.WRITE_THROUGH),
                          ssd_config=ssd_config(tmp_path / "ssd"), device="shm", root=NAMESPACE.root,
                          observer=IndexStats())
    yield manager
    manager.close()


def counts(manager: TierManager) -> tuple[int, TierCounts, TierCounts, tuple[int, int]]:
    """(query blocks, hits by tier, declined by tier, the index observer's (query, hit) tokens)."""
    stats = manager.stats()
    hits = TierCounts(*(usage.num_hit_blocks for usage in stats.tiers), stats.num_t3_hit_blocks)
    observer = manager.tiers.index._observer
    assert isinstance(observer, IndexStats)
    return stats.num_query_blocks, hits, stats.num_skipped_slow_blocks, (observer.num_query_tokens,
                                                                         observer.num_hit_tokens)


def looked_up(manager: TierManager, num_query_blocks: int) -> tuple[TierCounts, TierCounts]:
    """What the Lookup RPC does with a query: answer, weigh, count."""
    hits = manager.lookup(ASKED_CHAIN, ASKED)
    declined = manager.declined(hits)
    manager.count_query(hits, declined, num_query_blocks)
    return hits, declined


def test_a_lookup_counts_its_query_the_promised_hits_per_tier_and_the_declined_ones_once(manager):
    """Blocks 0-1 in T1, 2-3 only on a disk slower than recompute, 4-5 nowhere: 6 query blocks,
    2 T1 hits, 2 T2 declined (misses); the Acquire loading the 2 promised blocks adds nothing."""
    t1_then_slow_t2(manager)
    manager.report_recompute(FAST_RECOMPUTE_S)
    before = counts(manager)
    hits, declined = looked_up(manager, len(ASKED_CHAIN))
    assert (hits, declined) == (SPLIT, TierCounts(t2=2))
    after = counts(manager)
    assert after[0] - before[0] == 6
    assert after[1] - before[1] == TierCounts(t1=2)
    assert after[2] - before[2] == TierCounts(t2=2)
    assert (after[3][0] - before[3][0], after[3][1] - before[3][1]) == (6 * BLOCK_SIZE, 0)  # no T0 hit

    load = manager.acquire("load", CHAIN[:2], 0, PROMPT[:2 * BLOCK_SIZE], recompute_s_per_token=None,
                           counting=QueryCounting.NOTHING)
    assert load.num_t1_blocks == 2 and load.ticket.wait(10) == 2
    manager.release("load")
    assert counts(manager) == after


def test_a_lookup_counts_t0_hits_in_the_index_observer_too(manager):
    """The metrics' hit tokens in T0 come from the index observer: a Lookup's T0 hits reach it."""
    prefill(manager, "a", PROMPT)
    manager.release("a")
    before = counts(manager)
    hits, _ = looked_up(manager, len(ASKED_CHAIN))
    assert hits == TierCounts(t0=4)
    after = counts(manager)
    assert (after[0] - before[0], after[1] - before[1]) == (6, TierCounts(t0=4))
    assert (after[3][0] - before[3][0], after[3][1] - before[3][1]) == (6 * BLOCK_SIZE, 4 * BLOCK_SIZE)


def test_a_query_of_fewer_blocks_than_the_chain_counts_only_their_hits(manager):
    """num_query_blocks 3 of a chain whose first 2 are in T1 and next 2 declined: 2 T1 hits, 1 declined."""
    t1_then_slow_t2(manager)
    manager.report_recompute(FAST_RECOMPUTE_S)
    before = counts(manager)
    looked_up(manager, 3)
    after = counts(manager)
    assert (after[0] - before[0], after[1] - before[1], after[2] - before[2]) == (3, TierCounts(t1=2),
                                                                                  TierCounts(t2=1))


def test_a_lookup_without_a_query_counts_nothing(manager):
    t1_then_slow_t2(manager)
    manager.report_recompute(FAST_RECOMPUTE_S)
    before = counts(manager)
    hits = manager.lookup(ASKED_CHAIN, ASKED)
    assert manager.declined(hits) == TierCounts(t2=2)
    assert counts(manager) == before


def test_an_acquire_without_a_lookup_counts_its_query_and_the_hits_it_loads(manager):
    """The reference runner's way: the Acquire is the query; its T1 hits count once they landed,
    the slow T2 blocks it leaves as declined."""
    t1_then_slow_t2(manager)
    manager.report_recompute(FAST_RECOMPUTE_S)
    before = counts(manager)
    acquisition = manager.acquire("b", ASKED_CHAIN, 0, ASKED)
    assert acquisition.num_t1_blocks == 2 and acquisition.ticket.wait(10) == 2
    manager.release("b")
    after = counts(manager)
    assert (after[0] - before[0], after[1] - before[1], after[2] - before[2]) == (6, TierCounts(t1=2),
                                                                                  TierCounts(t2=2))
    assert after[3][0] - before[3][0] == 6 * BLOCK_SIZE
