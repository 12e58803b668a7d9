"""What `kvtierctl stats` says for tuning eviction, from a pool's Stats: the hit rate beside an
unbounded cache's, the query tokens by the tier that served them, and per tier why blocks left
and how long they had stayed (docs/operations.md, "Tuning eviction"). Pure functions."""

from __future__ import annotations

from kvtierd.index.residency import LeaveReason
from kvtierd.tier import Tier
from kvtierd.v1 import kvtier_pb2 as pb


def served_blocks(pool: pb.PoolStats) -> dict[str, int]:
    """Query blocks by the tier that served them, then "miss": they add up to the query blocks."""
    served: dict[str, int] = {t.tier: t.num_hit_blocks for t in pool.tiers}
    if pool.HasField("t3"):
        served[Tier.T3] = pool.t3.num_query_hit_blocks  # the store's reads count prefetches too
    served["miss"] = pool.num_miss_blocks
    return served


def hit_rate_words(pool: pb.PoolStats) -> str:
    """'hit rate 41.2% (an unbounded cache: 77.0%) of 1,280 query tokens (T0 30.0%, ..., miss 58.8%)'."""
    queries = pool.num_query_blocks
    if not queries:
        return "no queries yet"
    split = ", ".join(f"{tier.upper() if tier != 'miss' else tier} {n / queries:.1%}"
                      for tier, n in served_blocks(pool).items())
    return (f"hit rate {pool.hit_rate:.1%} (an unbounded cache: {pool.unbounded_hit_rate:.1%}) of "
            f"{queries * pool.layout.block_size:,} query tokens ({split})")


def residency_lines(pool: pb.PoolStats) -> list[str]:
    """Per tier: how many blocks left by reason, and how long they had stayed (p50 / p90)."""
    lines = []
    for tier in pool.tiers:
        left = {entry.reason: entry.num_blocks for entry in tier.left}
        if not tier.left:
            continue
        counts = ", ".join(f"{left.get(reason, 0):,} {reason}" for reason in LeaveReason)
        stayed = (f"stayed p50 {seconds_words(tier.residency_p50_s)}, p90 {seconds_words(tier.residency_p90_s)}"
                  if sum(left.values()) else "none left yet")
        lines.append(f"  left {tier.tier}: {counts}; {stayed}")
    return lines


def seconds_words(seconds: float) -> str:
    """A duration for a reader: '850 ms', '12.5 s', '4.2 min', '3.1 h'."""
    if seconds < 1:
        return f"{seconds * 1e3:.0f} ms"
    if seconds < 120:
        return f"{seconds:.3g} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"
