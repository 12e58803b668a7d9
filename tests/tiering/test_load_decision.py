"""Which lower-tier hits are loaded (tiering/load_decision.py) and the cost they are weighed
against (tiering/recompute_cost.py): per tier, the prefix broken once, the operator's override,
no measurement no decline."""

from __future__ import annotations

import math

import pytest

from kvtierd.errors import InvalidArgument
from kvtierd.movers.copy_engine import Bandwidth
from kvtierd.tier import Tier, TierCounts
from kvtierd.tiering.load_decision import MIN_SAMPLES, declined, expected_load_s, worth_loading
from kvtierd.tiering.recompute_cost import CostSource, RecomputeCost
from tests.tiering.tier_factories import measure

BLOCK_SIZE = 16
MIB = 1 << 20


def measured(bytes_per_s: float) -> Bandwidth:
    """A bandwidth measured at `bytes_per_s`, enough times to be weighed."""
    return measure(Bandwidth(initial_bytes_per_s=1e12), bytes_per_s)  # a first guess the samples replace


def paths(t1: Bandwidth, t2: Bandwidth, t3: Bandwidth):
    """Each tier's path of one hop, one MiB a block."""
    links = {Tier.T1: t1, Tier.T2: t2, Tier.T3: t3}
    return lambda tier, num_blocks: [(links[tier], num_blocks * MIB)]


def test_a_load_is_taken_only_when_expected_faster_than_recompute():
    """4 MiB at 1 GiB/s take ~3.9 ms: worth it against 64 tokens at 100 us (6.4 ms), not at 50 us (3.2 ms)."""
    path = [(measured(1 << 30), 4 * MIB)]
    assert expected_load_s(path) == pytest.approx(4 / 1024)
    assert worth_loading(64, path, 100e-6)
    assert not worth_loading(64, path, 50e-6)


def test_with_no_cost_known_every_hit_is_loaded():
    assert worth_loading(64, [(measured(1.0), 4 * MIB)], None)
    assert declined(TierCounts(1, 2, 3, 4), paths(measured(1.0), measured(1.0), measured(1.0)), BLOCK_SIZE,
                    None) == TierCounts()


def test_a_hop_never_measured_costs_nothing_whatever_its_first_guess():
    """A pessimistic first guess (1 B/s) never declines a tier: the load that follows measures it."""
    guessed = Bandwidth(initial_bytes_per_s=1.0)
    assert expected_load_s([(guessed, 4 * MIB)]) == 0
    assert worth_loading(64, [(guessed, 4 * MIB)], 1e-9)
    assert expected_load_s([(guessed, 4 * MIB), (measured(MIB), MIB)]) == pytest.approx(1.0)


def test_fewer_than_min_samples_never_decline_and_one_stalled_copy_does_not_once_measured():
    """A 16 KiB copy stalled 10 ms by the scheduler (1.6 MB/s) among copies at 5 GB/s: weighed alone it
    would make 112 KiB cost 70 ms, more than recomputing 112 tokens at 0.1 ms; it is never weighed
    alone, and among MIN_SAMPLES - 1 healthy copies the median ignores it."""
    bandwidth = Bandwidth(initial_bytes_per_s=5e9)
    bandwidth.record(16 << 10, 10e-3)
    path = [(bandwidth, 112 << 10)]
    assert expected_load_s(path) == 0 and worth_loading(112, path, 1e-4)
    for _ in range(MIN_SAMPLES - 1):
        bandwidth.record(5 << 20, 1e-3)
    assert bandwidth.bytes_per_s == pytest.approx(5 * MIB / 1e-3)
    assert worth_loading(112, path, 1e-4)
    for _ in range(MIN_SAMPLES):  # the copies are slow now, not one stalled: the tier is declined
        bandwidth.record(16 << 10, 10e-3)
    assert not worth_loading(112, path, 1e-4)


def test_a_declined_tier_loaded_anyway_is_not_declined_nor_are_the_tiers_after_it():
    """`load_anyway(T1)` (T1's remeasure due): T1's hits load, T2 is weighed on its own."""
    fast, slow = measured(100 * (1 << 30)), measured(MIB)
    hits = TierCounts(t1=2, t2=3, t3=4)
    asked = []

    def t1_due(tier: Tier) -> bool:
        asked.append(tier)
        return tier is Tier.T1

    assert declined(hits, paths(slow, fast, fast), BLOCK_SIZE, 1e-3, t1_due) == TierCounts()
    assert declined(hits, paths(slow, slow, fast), BLOCK_SIZE, 1e-3, t1_due) == TierCounts(t2=3, t3=4)
    assert asked == [Tier.T1, Tier.T1, Tier.T2]  # asked only of tiers about to be declined


def test_each_tier_is_weighed_for_its_own_blocks_and_the_prefix_breaks_at_the_first_slow_one():
    """T1 fast, T2 slow, T3 fast: T2 and everything after it is declined; T0 never is."""
    fast, slow = measured(100 * (1 << 30)), measured(MIB)
    hits = TierCounts(t0=5, t1=2, t2=3, t3=4)
    assert declined(hits, paths(fast, slow, fast), BLOCK_SIZE, 1e-3) == TierCounts(t2=3, t3=4)
    assert declined(hits, paths(slow, fast, fast), BLOCK_SIZE, 1e-3) == TierCounts(t1=2, t2=3, t3=4)
    assert declined(hits, paths(fast, fast, fast), BLOCK_SIZE, 1e-3) == TierCounts()


def test_a_tier_without_hits_is_not_weighed():
    """T2 is slow but holds none of the chain: T3's hits after T1's are weighed on their own."""
    fast, slow = measured(100 * (1 << 30)), measured(1.0)
    assert declined(TierCounts(t1=2, t3=4), paths(fast, slow, fast), BLOCK_SIZE, 1e-3) == TierCounts()


def test_the_measured_cost_is_a_moving_average_of_every_engine_s_reports():
    cost = RecomputeCost(weight=0.5)
    assert cost.s_per_token is None and cost.estimate().source is CostSource.UNKNOWN
    cost.report(0.0)  # an engine that has not measured yet
    assert cost.s_per_token is None
    cost.report(2e-4)
    cost.report(4e-4)
    assert cost.s_per_token == pytest.approx(3e-4)
    estimate = cost.estimate()
    assert (estimate.source, estimate.num_reports) == (CostSource.MEASURED, 2)


def test_the_operator_s_override_wins_over_the_engines_reports():
    cost = RecomputeCost(override_s=1e-3)
    cost.report(1e-6)
    assert cost.s_per_token == 1e-3
    assert cost.estimate().source is CostSource.POLICY and cost.estimate().num_reports == 1


@pytest.mark.parametrize("bad", [-1e-4, math.nan, math.inf])
def test_a_bad_report_is_refused_and_changes_nothing(bad):
    cost = RecomputeCost()
    cost.report(1e-4)
    with pytest.raises(InvalidArgument, match="recompute_s_per_token"):
        cost.report(bad)
    assert cost.s_per_token == 1e-4 and cost.estimate().num_reports == 1
