"""The tiers as a type: the names on the wire, in metrics and on the command line stay the strings
they always were; per-tier counts add, sum and unpack tier by tier, top down."""

from __future__ import annotations

import json

import pytest

from kvtierd.chain_lookup import ChainLookup, declined_tail
from kvtierd.errors import FailedPrecondition
from kvtierd.tier import LOCAL_TIERS, LOWER_TIERS, Edge, Tier, TierCounts
from kvtierd.v1 import kvtier_pb2 as pb
from kvtierd.wire.conversions import (
    acquired_from_proto,
    hits_from_proto,
    hits_to_proto_fields,
    lookup_from_proto,
    lookup_to_proto,
)


def test_tier_and_edge_names_are_the_strings_they_replace():
    assert [str(tier) for tier in Tier] == ["t0", "t1", "t2", "t3"]
    assert [f"{edge}" for edge in Edge] == ["t0_t1", "t1_t2", "t1_t3", "t2_t3"]
    assert json.dumps({Tier.T2: [Edge.T1_T3]}) == '{"t2": ["t1_t3"]}'
    assert pb.TierStats(tier=Tier.T1).SerializeToString() == pb.TierStats(tier="t1").SerializeToString()
    assert "t2" == Tier.T2 and {"t3": 1}[Tier.T3] == 1


def test_tiers_are_ordered_top_down_and_edges_name_their_ends():
    assert [tier.level for tier in Tier] == [0, 1, 2, 3]
    assert LOWER_TIERS == (Tier.T1, Tier.T2, Tier.T3) and LOCAL_TIERS == (Tier.T0, Tier.T1, Tier.T2)
    assert Edge.between(Tier.T2, Tier.T3) is Edge.T2_T3
    assert (Edge.T1_T3.upper, Edge.T1_T3.lower) == (Tier.T1, Tier.T3)
    with pytest.raises(ValueError):
        Edge.between(Tier.T0, Tier.T3)  # no such edge: T0 copies down into T1 only


def test_counts_add_tier_by_tier_and_sum_from_zero():
    a, b = TierCounts(1, 2, 3, 4), TierCounts(t1=5, t3=1)
    assert a + b == TierCounts(1, 7, 3, 5)
    assert sum([a, b, b]) == TierCounts(1, 12, 3, 6)
    assert (a.num_blocks, a.num_lower_blocks) == (10, 9)


def test_a_chain_s_counts_cut_to_its_first_blocks_keep_the_top_tiers_and_subtract_tier_by_tier():
    counts = TierCounts(t0=1, t1=2, t2=3, t3=4)
    assert [counts.first(n) for n in (0, 1, 2, 4, 10, 99)] == [
        TierCounts(), TierCounts(t0=1), TierCounts(t0=1, t1=1), TierCounts(t0=1, t1=2, t2=1), counts, counts]
    assert counts.first(-3) == TierCounts()
    assert counts - counts.first(4) == TierCounts(t2=2, t3=4)


def test_counts_are_read_by_tier_and_unpack_top_down():
    counts = TierCounts.of(Tier.T2, 3).replace(Tier.T0, 1)
    assert (counts[Tier.T2], counts["t0"], counts[Tier.T3]) == (3, 1, 0)
    t0, t1, t2, t3 = counts
    assert (t0, t1, t2, t3) == (1, 0, 3, 0)
    assert counts.items() == ((Tier.T0, 1), (Tier.T1, 0), (Tier.T2, 3), (Tier.T3, 0))


def test_the_wire_keeps_its_fields_and_converts_both_ways():
    hits = TierCounts(2, 1, 0, 4)
    message = pb.ChainHits(**hits_to_proto_fields(hits))
    assert (message.num_hit_blocks, message.num_t0_blocks, message.num_t3_blocks) == (7, 2, 4)
    assert hits_from_proto(message) == hits
    acquired = pb.AcquireResponse(num_t0_hit_blocks=3, num_t1_blocks=1, num_t2_blocks=0, num_t3_blocks=2)
    assert acquired_from_proto(acquired) == TierCounts(3, 1, 0, 2)


def test_a_chain_s_declined_blocks_are_its_last_from_the_lowest_tier_up():
    hits = TierCounts(t0=1, t1=2, t2=2, t3=1)
    assert declined_tail(hits, 0) == TierCounts()
    assert declined_tail(hits, 3) == TierCounts(t2=2, t3=1)
    assert declined_tail(hits, 4) == TierCounts(t1=1, t2=2, t3=1)
    answer = ChainLookup((hits,), (declined_tail(hits, 4),))
    assert answer.kept == (TierCounts(t0=1, t1=1),) and answer.num_declined_blocks == 4


def test_a_lookup_s_answer_crosses_the_wire_unchanged_per_chain_and_in_total():
    a, b = TierCounts(t0=2, t2=3), TierCounts(t1=1, t3=2)
    answer = ChainLookup((a, b, TierCounts()), (declined_tail(a, 2), TierCounts(), TierCounts()))
    message = lookup_to_proto(answer, per_chain=True)
    assert (message.num_hit_blocks, message.num_t2_blocks, message.num_declined_blocks) == (8, 3, 2)
    assert lookup_from_proto(message, 3) == answer
    assert answer.total == TierCounts(t0=2, t1=1, t2=3, t3=2)
    one = lookup_to_proto(ChainLookup((a,), (TierCounts(),)), per_chain=False)  # no chain_lengths: no chains
    assert not one.chains and lookup_from_proto(one, 0).hits == (a,)
    assert lookup_from_proto(one, 1).hits == (a,)  # a daemon older than chain_lengths: one chain, at the top


def test_an_answer_the_client_cannot_trust_is_refused_whole():
    a = TierCounts(t0=2)
    two = lookup_to_proto(ChainLookup((a, a), (TierCounts(), TierCounts())), per_chain=True)
    with pytest.raises(FailedPrecondition, match="2 of the 3 chains"):
        lookup_from_proto(two, 3)
    bad = pb.LookupResponse(chains=[pb.ChainHits(num_hit_blocks=1, num_t0_blocks=1, num_declined_blocks=2)])
    with pytest.raises(FailedPrecondition, match="declined more blocks"):
        lookup_from_proto(bad, 1)
