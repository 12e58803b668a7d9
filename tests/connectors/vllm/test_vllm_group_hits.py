"""Where a hybrid request's hit ends: vLLM's rule (every full-attention block, the sliding window
before the end, the Mamba state at the end) over per-position presence, on every TP rank."""

from __future__ import annotations

import dataclasses

import pytest

from kvtierd.connectors.vllm.daemon_lookup import group_presence, lookup_request, num_query_blocks
from kvtierd.connectors.vllm.group_hits import (
    ABSENT,
    NO_HIT,
    across_ranks,
    leading_presence,
    needed_positions,
    primary_group,
    request_hit,
)
from kvtierd.connectors.vllm.kv_groups import EngineGroups, GroupKind, ServedGroup
from kvtierd.connectors.vllm.lookup_query import LookupQuery
from kvtierd.tier import TierCounts
from kvtierd.v1 import kvtier_pb2 as pb
from kvtierd.wire.conversions import lookup_from_proto

FULL = ServedGroup(1, GroupKind.FULL, ("a",), 64, 4)
SLIDING = ServedGroup(0, GroupKind.SLIDING, ("s",), 64, 4, window_tokens=9)  # cdiv(8, 4) = 2 blocks
MAMBA = ServedGroup(2, GroupKind.MAMBA, ("m",), 64, 4)
T0, T1, T2 = 1, 2, 3


def answer_of(*chains: pb.ChainHits):
    """The client's answer to a Lookup of these chains, as the daemon would send it."""
    return lookup_from_proto(pb.LookupResponse(chains=list(chains)), len(chains))


def test_presence_from_a_chains_tier_counts_and_across_ranks():
    assert leading_presence(TierCounts(2, 1, 0, 0), 5) == [T0, T0, T1, ABSENT, ABSENT]
    assert across_ranks([[T0, T0, T1, ABSENT], [T0, T2, ABSENT, T0]]) == [T0, T2, ABSENT, ABSENT]


def test_the_positions_each_kind_needs():
    assert list(needed_positions(FULL, 5)) == [0, 1, 2, 3, 4]
    assert list(needed_positions(SLIDING, 5)) == [3, 4] and list(needed_positions(SLIDING, 1)) == [0]
    assert list(needed_positions(MAMBA, 5)) == [4]


def test_full_attention_alone_is_its_leading_run_with_its_tiers():
    hit = request_hit([FULL], [[T0, T0, T1, ABSENT, T0]])
    assert (hit.num_blocks, hit.tier_blocks, hit.all_in_t0) == (3, TierCounts(2, 1, 0, 0), False)
    assert request_hit([FULL], [[ABSENT, T0]]) == NO_HIT


def test_a_sliding_window_hole_before_the_window_does_not_matter_inside_it_does():
    """Full holds 6; the window group lacks position 1 (outside the window of 6) but holds 4 and 5."""
    full = [T0] * 6
    assert request_hit([SLIDING, FULL], [[T0, ABSENT, T0, T0, T0, T0], full]).num_blocks == 6
    # position 4 absent: the windows of 6 and 5 break; 4's window is [2, 3]
    assert request_hit([SLIDING, FULL], [[T0, T0, T0, T0, ABSENT, T0], full]).num_blocks == 4


def test_a_mamba_hit_ends_where_a_state_is_and_full_attention_reaches():
    """States at 2 and 5 (positions 1 and 4); full holds 4 blocks: the hit is 2 blocks."""
    hit = request_hit([MAMBA, FULL], [[ABSENT, T1, ABSENT, ABSENT, T0, ABSENT], [T0] * 4 + [ABSENT] * 2])
    assert (hit.num_blocks, hit.tier_blocks, hit.all_in_t0) == (2, TierCounts(2, 0, 0, 0), False)  # the state is in T1
    assert request_hit([MAMBA, FULL], [[ABSENT] * 3, [T0] * 3]) == NO_HIT


ENGINE = EngineGroups((SLIDING, FULL, MAMBA), 4, 4, 64, uniform_attention=False)


def test_one_lookup_asks_a_chain_per_attention_group_and_one_per_candidate_state_the_full_group_first():
    """The full-attention group's chain comes first (the query the daemon counts); the answers come
    back to each group in engine order."""
    query = LookupQuery(5, ((b"s5", b"s6", b"s7"), (b"f5", b"f6", b"f7"), (b"m5", b"m6", b"m7")),
                        tuple(range(12)))
    hashes, tokens, lengths = lookup_request(ENGINE, query)
    assert hashes == [b"f5", b"f6", b"f7", b"s5", b"s6", b"s7", b"m5", b"m6", b"m7"]
    assert lengths == [3, 3, 1, 1, 1] and tokens == list(range(12)) * 3
    answers = answer_of(pb.ChainHits(num_hit_blocks=2, num_t0_blocks=1, num_t2_blocks=1),
                        pb.ChainHits(num_hit_blocks=3, num_t0_blocks=3),
                        pb.ChainHits(), pb.ChainHits(num_hit_blocks=1, num_t1_blocks=1),
                        pb.ChainHits(num_hit_blocks=1, num_t0_blocks=1))
    assert group_presence(ENGINE, answers, 3) == ([[T0, T0, T0], [T0, T2, ABSENT], [ABSENT, T1, T0]], TierCounts())


def test_a_request_s_first_lookup_names_every_candidate_position_of_the_first_chain_as_the_query():
    """vLLM counts a hit in positions, so the query is the primary chain's positions, not the sum of
    the blocks each group would load; a repeated ask, and a model of Mamba groups only, name none."""
    query = LookupQuery(5, ((b"s5", b"s6", b"s7"), (b"f5", b"f6", b"f7"), (b"m5", b"m6", b"m7")),
                        tuple(range(12)), count_query=True)
    assert num_query_blocks(ENGINE, query) == 3 == lookup_request(ENGINE, query)[2][0]
    assert num_query_blocks(ENGINE, dataclasses.replace(query, count_query=False)) == 0
    sliding_first = EngineGroups((MAMBA, SLIDING), 4, 4, 64, uniform_attention=False)
    assert primary_group(sliding_first.groups) == 1
    assert num_query_blocks(sliding_first, LookupQuery(0, ((b"m",), (b"s",)), tuple(range(4)), True)) == 1
    only_states = EngineGroups((MAMBA,), 4, 4, 64, uniform_attention=False)
    assert num_query_blocks(only_states, LookupQuery(0, ((b"m0", b"m1"),), tuple(range(8)), True)) == 0


def test_blocks_the_daemon_declines_are_no_hit_and_the_full_group_s_are_reported():
    """The sliding group's T2 block and the full group's two T2 blocks are declined as slower than
    recompute, and so is the state in T1: vLLM computes them all."""
    answers = answer_of(pb.ChainHits(num_hit_blocks=3, num_t0_blocks=1, num_t2_blocks=2, num_declined_blocks=2),
                        pb.ChainHits(num_hit_blocks=3, num_t0_blocks=2, num_t2_blocks=1, num_declined_blocks=1),
                        pb.ChainHits(num_hit_blocks=1, num_t0_blocks=1),
                        pb.ChainHits(num_hit_blocks=1, num_t1_blocks=1, num_declined_blocks=1), pb.ChainHits())
    presence, declined = group_presence(ENGINE, answers, 3)
    assert presence == [[T0, T0, ABSENT], [T0, ABSENT, ABSENT], [T0, ABSENT, ABSENT]]
    assert declined == TierCounts(t2=2)
    assert request_hit(ENGINE.groups, presence).num_blocks == 1


@pytest.mark.parametrize("num_candidates", [1, 7, 64])
def test_the_hit_is_the_largest_every_group_serves(num_candidates):
    """Against a brute force over every candidate length, on a pattern with holes in every group."""
    presence = [[(T0 if (p * 7 + g) % 5 else ABSENT) for p in range(num_candidates)] for g in range(3)]
    presence[1] = [T0] * num_candidates  # full attention holds everything
    groups = [SLIDING, FULL, MAMBA]
    best = max((n for n in range(num_candidates + 1) if n == 0 or all(
        presence[i][p] != ABSENT for i, g in enumerate(groups) for p in needed_positions(g, n))), default=0)
    assert request_hit(groups, presence).num_blocks == best
