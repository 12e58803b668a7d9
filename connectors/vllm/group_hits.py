"""Where a request's external hit ends when every KV cache group must serve it: vLLM's hybrid
rule over the daemon's answers.

The daemon answers, per group and TP rank, which of the candidate positions after the engine's
own hit it holds and in which tier (`Presence`: 0 absent, else the tier + 1). A hit of N blocks
(positions [0, N) of the candidates, relative to the first block the engine lacks) needs, as
vLLM's coordinator requires of its own cache (vllm/v1/core/kv_cache_coordinator.py, the managers
in single_type_kv_cache_manager.py):
- full attention: every position in [0, N);
- sliding window: the `num_window_blocks` positions before N (those before the candidates are
  the engine's own: its hit already covered their window);
- Mamba: the state at N, i.e. position N - 1.
The hit is the largest such N for every group on every rank; a rank that lacks a block makes it
absent (a hit is what every rank holds). Blocks the daemon holds but declines, being slower to
load than to recompute (ChainLookup.declined, the trailing ones of a chain's hit),
are absent too: vLLM computes them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from kvtierd.connectors.vllm.kv_groups import GroupKind, ServedGroup
from kvtierd.tier import Tier, TierCounts

ABSENT = 0
T0 = Tier.T0.level + 1  # Presence values: the tier's level + 1 (T0 = 1, T1 = 2, T2 = 3, T3 = 4)

# Per candidate position: ABSENT, or the tier's level + 1 that holds the block.
Presence = list[int]


def leading_presence(tier_counts: TierCounts, num_positions: int) -> Presence:
    """A chain lookup's answer (its leading blocks per tier, T0 first) as per-position presence."""
    presence: Presence = []
    for tier, count in tier_counts.items():
        presence += [tier.level + 1] * count
    assert len(presence) <= num_positions, (tier_counts, num_positions)
    return presence + [ABSENT] * (num_positions - len(presence))


def across_ranks(per_rank: Sequence[Presence]) -> Presence:
    """One group's presence on every rank: absent where any rank lacks the block, else the slowest tier."""
    return [ABSENT if ABSENT in column else max(column) for column in zip(*per_rank)]


def primary_group(groups: Sequence[ServedGroup]) -> int:
    """The index of the group whose blocks stand for the hit (its tiers, the daemon's query): the
    first full-attention group, else the first sliding-window one, else the first."""
    for kind in (GroupKind.FULL, GroupKind.SLIDING):
        index = next((i for i, group in enumerate(groups) if group.kind is kind), None)
        if index is not None:
            return index
    return 0


def needed_positions(group: ServedGroup, num_blocks: int) -> range:
    """The candidate positions a hit of `num_blocks` needs from `group`."""
    window = group.num_window_blocks
    return range(0 if window == 0 else max(0, num_blocks - window), num_blocks)


@dataclasses.dataclass(frozen=True, slots=True)
class RequestHit:
    """The blocks beyond the engine's own hit that every group can serve from the daemon."""

    num_blocks: int
    tier_blocks: TierCounts  # of the primary group's needed blocks: in T0, T1, T2, T3
    all_in_t0: bool  # every needed block of every group is in T0: a synchronous copy serves it
    # held after the loadable ones but declined as slower than recompute (TP rank 0, first full group)
    declined: TierCounts = TierCounts()

    @property
    def num_t0_blocks(self) -> int:
        return self.tier_blocks.t0


NO_HIT = RequestHit(0, TierCounts(), True)


def request_hit(groups: Sequence[ServedGroup], presence: Sequence[Presence]) -> RequestHit:
    """The largest hit every group serves (presence[i] is groups[i]'s, all of one length).

    Full-attention groups bound it by their leading run; below that bound each candidate costs
    only the windows' and states' checks."""
    assert len(groups) == len(presence) and presence
    bound = len(presence[0])
    for group, presence_of in zip(groups, presence):
        if group.kind is GroupKind.FULL:
            bound = min(bound, presence_of.index(ABSENT) if ABSENT in presence_of else len(presence_of))
    partial = [(group, presence_of) for group, presence_of in zip(groups, presence) if group.kind is not GroupKind.FULL]
    for num_blocks in range(bound, 0, -1):
        if all(presence_of[p] != ABSENT for group, presence_of in partial for p in needed_positions(group, num_blocks)):
            return _hit(groups, presence, num_blocks)
    return NO_HIT


def _hit(groups: Sequence[ServedGroup], presence: Sequence[Presence], num_blocks: int) -> RequestHit:
    counts = [0] * len(Tier)
    primary = primary_group(groups)
    for p in needed_positions(groups[primary], num_blocks):
        counts[presence[primary][p] - 1] += 1
    all_in_t0 = all(presence_of[p] == T0 for group, presence_of in zip(groups, presence)
                    for p in needed_positions(group, num_blocks))
    return RequestHit(num_blocks, TierCounts(*counts), all_in_t0)
