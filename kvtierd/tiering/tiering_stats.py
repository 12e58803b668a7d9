"""The statistics of one layout's tiers, as one typed object built in one place.

`tiering_stats(tiers)` is what `TierManager.stats()` returns. The Stats RPC
(server/pool_stats.py) and the Prometheus collector (metrics/metrics_collector.py) read it;
kvtierctl reads the Stats RPC. Nothing else derives tier figures, so the three agree.

Every count is this layout's own, so a node's figure is the sum over its layouts: bytes moved
are counted per layout (Tiers.submit), though the copy engine is the device's. The one shared
figure is the bandwidth estimate, the device's link speed: the same in each layout on it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from kvtierd.index.distinct_keys import unbounded_hit_blocks
from kvtierd.index.residency import ResidencySnapshot
from kvtierd.t2.ssd_stats import SsdStats
from kvtierd.t3.remote_tier import RemoteTierStats
from kvtierd.tier import Edge, Tier, TierCounts
from kvtierd.tiering.layout_tiers import Tiers
from kvtierd.tiering.leave_reasons import residencies
from kvtierd.tiering.recompute_cost import CostEstimate


@dataclasses.dataclass(frozen=True, slots=True)
class TierUsage:
    """One tier's occupancy and traffic: the same fields for T0, T1 and T2."""

    tier: Tier  # T0, T1 or T2
    capacity_bytes: int
    used_bytes: int
    num_cached_blocks: int  # blocks a lookup can hit
    num_hit_blocks: int  # hits of queries in this tier, since start (query_counting.py)
    num_evictions: int  # cached blocks dropped to make room, since start
    codec: str  # how a slot holds a block ("raw", "fp8"); T0 holds the layout's dtype: "raw"
    num_quota_skips: int = 0  # T1/T2 stores refused because the tenant was at its quota
    pinned_bytes: int = 0  # T1 with CUDA: page-locked so far (the part it serves)
    pinning: bool = False  # T1: still being page-locked in the background
    fair_share_bytes: int = 0  # T1, T2: what this layout is guaranteed of the node's budget now (0: T0)


@dataclasses.dataclass(frozen=True, slots=True)
class TieringStats:
    """Counters of one layout's tiers since the daemon started; absent tiers are None."""

    num_blocks: int  # of the T0 pool
    num_free_blocks: int  # of the T0 pool: no request holds them (cached or empty)
    t0: TierUsage
    t1: TierUsage | None
    t2: TierUsage | None
    ssd: SsdStats | None  # T2's health and I/O, when T2 is configured
    t3: RemoteTierStats | None  # this layout's traffic with the shared store, when T3 is configured
    num_query_blocks: int  # blocks asked for by Acquire, Put and Get, or named as a query by a Lookup
    num_t3_hit_blocks: int  # hits of queries in T3, as each TierUsage's (t3.num_hit_blocks: the store's reads)
    num_skipped_slow_blocks: TierCounts  # lower-tier hits of queries declined as slower than recompute, by tier
    recompute: CostEstimate  # the cost those hits were weighed against (recompute_cost.py)
    num_failed_load_blocks: int
    num_failed_offload_blocks: int
    num_offloaded_blocks: Mapping[Edge, int]  # by edge
    num_dropped_offload_blocks: Mapping[Edge, int]  # by edge: not copied down (no room below, or refused)
    bytes_moved: Mapping[str, int]  # by copy direction (Direction values): this layout's copies only
    bandwidth_bytes_per_s: Mapping[str, float]  # by copy direction: the device's engine's, shared by its layouts
    # hinted blocks kept without their hint over a tenant's quota, counted per event (retention_hints.py)
    num_retention_downgraded_blocks: int = 0
    # per local tier present: how long blocks stayed and why they left (index/residency.py)
    residency: Mapping[Tier, ResidencySnapshot] = dataclasses.field(default_factory=dict)
    num_distinct_blocks: int = 0  # distinct keys ever committed into T0, estimated (index/distinct_keys.py)

    @property
    def num_served_blocks(self) -> TierCounts:
        """The query blocks each tier served (hits of queries, T3's included)."""
        return TierCounts(self.t0.num_hit_blocks, self.t1.num_hit_blocks if self.t1 else 0,
                          self.t2.num_hit_blocks if self.t2 else 0, self.num_t3_hit_blocks)

    @property
    def num_miss_blocks(self) -> int:
        """Query blocks no tier served (recomputed; declined hits included): with the served ones,
        exactly the query blocks."""
        return self.num_query_blocks - self.num_served_blocks.num_blocks

    @property
    def hit_rate(self) -> float:
        """Served query blocks over query blocks (0 without queries)."""
        return self.num_served_blocks.num_blocks / self.num_query_blocks if self.num_query_blocks else 0.0

    @property
    def unbounded_hit_rate(self) -> float:
        """The hit rate a cache without a size limit would have had on the same queries: every
        block but its first sight (index/distinct_keys.py); 0 without queries."""
        if not self.num_query_blocks:
            return 0.0
        return unbounded_hit_blocks(self.num_query_blocks, self.num_served_blocks.num_blocks,
                                    self.num_distinct_blocks) / self.num_query_blocks

    @property
    def tiers(self) -> tuple[TierUsage, ...]:
        """The tiers present, top down."""
        return tuple(usage for usage in (self.t0, self.t1, self.t2) if usage is not None)


def tiering_stats(tiers: Tiers) -> TieringStats:
    counters, index = tiers.counters, tiers.index
    hits = counters.num_hit_blocks
    t0_used_bytes = (index.num_blocks - index.num_free_blocks) * tiers.layout.bytes_per_block
    t0 = TierUsage(Tier.T0, tiers.pool.nbytes, t0_used_bytes, index.num_cached_blocks, hits.t0, index.num_evictions,
                   "raw")
    t1 = None
    if tiers.host is not None:
        host = tiers.host
        t1 = TierUsage(Tier.T1, host.capacity_bytes, host.used_bytes, host.index.num_ready, hits.t1,
                       host.index.num_evictions, host.codec.name, host.index.num_quota_skips, host.pinned_bytes,
                       host.pinning, host.share.share.share_bytes)
    ssd = tiers.ssd.stats() if tiers.ssd is not None else None
    t2 = None
    if ssd is not None:
        assert tiers.ssd_codec is not None, "made with T2"
        t2 = TierUsage(Tier.T2, ssd.capacity_bytes, ssd.used_bytes, ssd.num_cached_blocks, hits.t2, ssd.num_evictions,
                       tiers.ssd_codec.name, ssd.num_quota_skips, fair_share_bytes=ssd.share_bytes)
    bandwidth = tiers.engine.bandwidth
    return TieringStats(
        num_blocks=index.num_blocks, num_free_blocks=index.num_free_blocks, t0=t0, t1=t1, t2=t2, ssd=ssd,
        t3=tiers.remote.stats() if tiers.remote is not None else None,
        num_query_blocks=counters.num_query_blocks, num_t3_hit_blocks=hits.t3,
        num_skipped_slow_blocks=counters.num_skipped_slow_blocks,
        num_failed_load_blocks=counters.num_failed_load_blocks, recompute=tiers.recompute.estimate(),
        num_failed_offload_blocks=counters.num_failed_offload_blocks,
        num_offloaded_blocks=dict(counters.num_offloaded_blocks),
        num_dropped_offload_blocks=dict(counters.num_dropped_offload_blocks),
        bytes_moved=dict(counters.bytes_moved),
        bandwidth_bytes_per_s={d.value: b.bytes_per_s for d, b in bandwidth.items()},
        residency={tier: residency.snapshot() for tier, residency in residencies(tiers).items()},
        num_distinct_blocks=index.distinct_keys.estimate())
