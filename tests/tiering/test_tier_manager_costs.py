"""Lower-tier hits weighed against recompute in the tier manager: a chain whose first two blocks
are in T1 and last two only on a slow SSD loads T1's and recomputes the rest, a Lookup answers
the same and counts it only as a query, a prefetch reads only what would be loaded, the layout's
cost comes from the engines' reports unless the config overrides it, and with no cost every hit
is loaded."""

from __future__ import annotations

import pytest

from kvtierd.index.query_counting import QueryCounting
from kvtierd.tier import TierCounts
from kvtierd.tiering.load_decision import MIN_SAMPLES, Remeasures
from kvtierd.tiering.tier_config import EdgePolicy
from tests.factories import BLOCK_SIZE, NAMESPACE, tokens
from tests.tiering.test_tier_manager_ssd import ssd_config
from tests.tiering.tier_factories import assert_holds, make_manager, measure, prefill

PROMPT = tokens(300, 4 * BLOCK_SIZE)
CHAIN = NAMESPACE.hash_blocks(PROMPT)
SPLIT = TierCounts(t1=2, t2=2)  # where the chain lives once set up
FAST_RECOMPUTE_S = 1e-3  # per token: 2 blocks recompute in 2 * BLOCK_SIZE ms, an SSD at 1 kB/s reads them in seconds


def t1_then_slow_t2(manager, ssd_measured_bytes_per_s: float | None = 1000.0) -> None:
    """PROMPT's blocks 0-1 in T1 (and T2), blocks 2-3 only in T2, whose reads were measured at
    `ssd_measured_bytes_per_s` (None: never measured)."""
    prefill(manager, "a", PROMPT)
    manager.release("a")
    manager.drain()
    manager.index.evict(CHAIN)
    manager.drain()
    manager.tiers.host.index.remove(CHAIN[2:])
    assert manager.lookup(CHAIN, PROMPT) == SPLIT
    if ssd_measured_bytes_per_s is not None:
        measure(manager.tiers.ssd_read, ssd_measured_bytes_per_s)


@pytest.fixture
def make(tmp_path):
    """`make(**config)`: a manager with T1 and T2 (write-through), closed at teardown."""
    managers = []

    def build(**config):
        manager = make_manager(ssd_config=ssd_config(tmp_path / f"m{len(managers)}"),
                               t0_to_t1=EdgePolicy.WRITE_THROUGH, **config)
        managers.append(manager)
        return manager

    yield build
    for manager in managers:
        manager.close()


def test_an_acquire_loads_the_fast_tier_and_recomputes_from_the_first_slow_one(make):
    manager = make()
    t1_then_slow_t2(manager)
    manager.report_recompute(FAST_RECOMPUTE_S)
    acquisition = manager.acquire("b", CHAIN, 0, PROMPT)
    assert (acquisition.num_t1_blocks, acquisition.num_t2_blocks) == (2, 0)
    assert acquisition.ticket.wait(10) == 2  # the runner computes blocks 2 and 3
    assert_holds(manager, acquisition.block_ids[:2], CHAIN[:2])
    stats = manager.stats()
    assert stats.num_skipped_slow_blocks == TierCounts(t2=2)
    assert stats.t2.num_hit_blocks == 0 and stats.t1.num_hit_blocks == 2
    manager.release("b")
    manager.drain()
    assert manager.tiers.ssd_read.num_samples == MIN_SAMPLES  # the disk was not read (a re-measure is not due yet)


def test_a_declined_disk_is_read_again_in_the_background_once_due(make):
    """Not by the request (it recomputes): into T1, measuring the disk anew."""
    manager = make()
    t1_then_slow_t2(manager)
    manager.report_recompute(FAST_RECOMPUTE_S)
    manager.promoter.remeasures = Remeasures(interval_s=0.0)
    acquisition = manager.acquire("b", CHAIN, 0, PROMPT)
    assert acquisition.num_t2_blocks == 0 and acquisition.ticket.wait(10) == 2
    manager.release("b")
    manager.drain()
    assert manager.tiers.ssd_read.num_samples == MIN_SAMPLES + 1
    assert manager.lookup(CHAIN, PROMPT) == TierCounts(t0=2, t1=2)  # blocks 2-3 came up into T1


def test_a_lookup_answers_what_an_acquire_would_decline_and_counts_it_once_as_a_query(make):
    manager = make()
    t1_then_slow_t2(manager)
    manager.report_recompute(FAST_RECOMPUTE_S)
    hits = manager.lookup(CHAIN, PROMPT)
    assert hits == SPLIT  # where the blocks are: unchanged by the decision
    declined = manager.declined(hits)
    assert declined == TierCounts(t2=2)
    assert manager.stats().num_skipped_slow_blocks == TierCounts()  # asked again: not a query
    manager.count_query(hits, declined, len(CHAIN))
    assert manager.stats().num_skipped_slow_blocks == TierCounts(t2=2)


def test_a_store_s_acquire_declines_the_slow_tier_without_counting_it(make):
    manager = make()
    t1_then_slow_t2(manager)
    manager.report_recompute(FAST_RECOMPUTE_S)
    acquisition = manager.acquire("store", CHAIN, 0, PROMPT, counting=QueryCounting.NOTHING)
    assert acquisition.num_t2_blocks == 0 and acquisition.ticket.wait(10) == 2
    assert manager.stats().num_skipped_slow_blocks == TierCounts()
    manager.release("store")


def test_a_load_decided_by_a_lookup_is_not_weighed_again(make):
    """recompute_s_per_token=None (AcquireRequest.load_every_hit): the promised blocks all load."""
    manager = make()
    t1_then_slow_t2(manager)
    manager.report_recompute(FAST_RECOMPUTE_S)
    acquisition = manager.acquire("b", CHAIN, 0, PROMPT, recompute_s_per_token=None)
    assert (acquisition.num_t1_blocks, acquisition.num_t2_blocks) == (2, 2)
    assert acquisition.ticket.wait(30) == 4
    assert_holds(manager, acquisition.block_ids, CHAIN)
    manager.release("b")


def test_with_no_report_every_hit_is_loaded(make):
    manager = make()
    t1_then_slow_t2(manager)
    acquisition = manager.acquire("b", CHAIN, 0, PROMPT)
    assert acquisition.ticket.wait(30) == 4
    assert manager.stats().recompute.s_per_token is None
    manager.release("b")


def test_a_never_measured_ssd_is_loaded_whatever_the_cost_and_its_read_measured(make):
    manager = make()
    t1_then_slow_t2(manager, ssd_measured_bytes_per_s=None)
    manager.report_recompute(1e-12)  # recompute all but free: only measured hops could lose to it
    acquisition = manager.acquire("b", CHAIN, 0, PROMPT)
    assert acquisition.ticket.wait(30) == 4
    assert manager.tiers.ssd_read.num_samples == 1
    manager.release("b")


def test_the_config_s_cost_overrides_the_engines_reports(make):
    """policy.recompute_s_per_token wins both ways: the reports say recompute is slow, it says fast."""
    manager = make(recompute_s_per_token=FAST_RECOMPUTE_S)
    t1_then_slow_t2(manager)
    manager.report_recompute(10.0)
    assert manager.acquire("b", CHAIN, 0, PROMPT).num_t2_blocks == 0
    manager.release("b")
    estimate = manager.stats().recompute
    assert (estimate.s_per_token, estimate.source, estimate.num_reports) == (FAST_RECOMPUTE_S, "policy", 1)


def test_a_prefetch_reads_only_what_would_be_loaded(make):
    manager = make()
    t1_then_slow_t2(manager)
    manager.report_recompute(FAST_RECOMPUTE_S)
    assert manager.lookup(CHAIN, PROMPT, prefetch=True) == SPLIT
    manager.drain()
    assert manager.lookup(CHAIN, PROMPT) == SPLIT  # the declined blocks stayed on the SSD
    assert manager.tiers.ssd_read.num_samples == MIN_SAMPLES  # the test's: no read
