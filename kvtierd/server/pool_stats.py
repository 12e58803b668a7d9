"""A pool's part of the Stats response, from its TieringStats (tiering/tiering_stats.py), and
the node's shared store (T3) part, as proto."""

from __future__ import annotations

import math

from kvtierd.index.residency import ResidencySnapshot
from kvtierd.node.pools import LayoutPool
from kvtierd.t2.node_budget import BudgetShare
from kvtierd.t3.redis_store import RedisStore
from kvtierd.t3.remote_tier import RemoteTierStats
from kvtierd.tiering.tiering_stats import TierUsage
from kvtierd.v1 import kvtier_pb2 as pb
from kvtierd.wire.conversions import layout_to_proto


def tier_message(usage: TierUsage, share: BudgetShare | None = None, num_declined_blocks: int = 0,
                 num_dropped_offload_blocks: int = 0, residency: ResidencySnapshot | None = None) -> pb.TierStats:
    """One tier's figures; with `share` (T1, T2), this layout's part of the node's budget beside it;
    with `residency`, why blocks left and how long they had stayed."""
    message = pb.TierStats(tier=usage.tier, capacity_bytes=usage.capacity_bytes, used_bytes=usage.used_bytes,
                           num_cached_blocks=usage.num_cached_blocks, num_hit_blocks=usage.num_hit_blocks,
                           num_evictions=usage.num_evictions, num_declined_blocks=num_declined_blocks,
                           pinned_bytes=usage.pinned_bytes, pinning=usage.pinning,
                           num_dropped_offload_blocks=num_dropped_offload_blocks)
    if share is not None:
        message.node_held_bytes, message.node_share_bytes = share.held_bytes, share.share_bytes
        message.node_capacity_bytes, message.node_used_bytes = share.node_capacity_bytes, share.node_used_bytes
    if residency is not None:
        message.left.extend(pb.LeftBlocks(reason=reason, num_blocks=counts.num_blocks, residency_sum_s=counts.sum_s)
                            for reason, counts in residency.by_reason.items())
        message.residency_p50_s, message.residency_p90_s = (_or_zero(residency.percentile_s(q)) for q in (50, 90))
    return message


def _or_zero(value: float) -> float:
    return 0.0 if math.isnan(value) else value


def pool_stats(pool: LayoutPool) -> pb.PoolStats:
    """The Stats message of one pool, from its tier manager's counters."""
    stats = pool.manager.stats()
    ssd = stats.ssd
    declined, recompute = stats.num_skipped_slow_blocks, stats.recompute
    transfers = [pb.TransferStats(direction=direction, bytes_moved=stats.bytes_moved[direction],
                                  bytes_per_s=stats.bandwidth_bytes_per_s[direction])
                 for direction in sorted(stats.bytes_moved)]
    return pb.PoolStats(layout=layout_to_proto(pool.layout), num_blocks=stats.num_blocks,
                        num_free_blocks=stats.num_free_blocks,
                        tiers=[tier_message(usage, pool.node_share(usage.tier), declined[usage.tier],
                                            sum(n for edge, n in stats.num_dropped_offload_blocks.items()
                                                if edge.lower == usage.tier), stats.residency.get(usage.tier))
                               for usage in stats.tiers],
                        num_query_blocks=stats.num_query_blocks, transfers=transfers,
                        num_corrupted_blocks=ssd.num_corrupted_blocks if ssd else 0,
                        num_unauthentic_blocks=ssd.num_unauthentic_blocks if ssd else 0,
                        t2_sealed=ssd.sealed if ssd else False,
                        num_t2_io_errors=ssd.num_io_errors if ssd else 0,
                        num_failed_load_blocks=stats.num_failed_load_blocks,
                        num_failed_offload_blocks=stats.num_failed_offload_blocks,
                        t2_admitting=ssd.admitting if ssd else False, t2_reason=ssd.reason if ssd else "",
                        t3=remote_tier_message(stats.t3, declined.t3, stats.num_t3_hit_blocks)
                        if stats.t3 is not None else None,
                        recompute_s_per_token=recompute.s_per_token or 0.0, recompute_source=recompute.source,
                        num_recompute_reports=recompute.num_reports, num_miss_blocks=stats.num_miss_blocks,
                        num_distinct_blocks=stats.num_distinct_blocks, hit_rate=stats.hit_rate,
                        unbounded_hit_rate=stats.unbounded_hit_rate)


def remote_tier_message(t3: RemoteTierStats, num_declined_blocks: int = 0,
                        num_query_hit_blocks: int = 0) -> pb.RemoteTierStats:
    """The store's own counts of this layout's traffic, with the hit rate's T3 figures beside them."""
    return pb.RemoteTierStats(
        codec=t3.codec, num_hit_blocks=t3.num_hit_blocks, num_miss_blocks=t3.num_miss_blocks,
        num_corrupt_blocks=t3.num_corrupt_blocks, num_written_blocks=t3.num_written_blocks,
        num_failed_writes=t3.num_failed_writes, num_dropped_writes=t3.num_dropped_writes, read_bytes=t3.read_bytes,
        written_bytes=t3.written_bytes, write_backlog_bytes=t3.write_backlog_bytes,
        read_bytes_per_s=t3.read_bytes_per_s, write_bytes_per_s=t3.write_bytes_per_s,
        num_declined_blocks=num_declined_blocks, num_query_hit_blocks=num_query_hit_blocks)


def remote_store_message(store: RedisStore | None) -> pb.RemoteStoreStats:
    """The node's shared store: its breaker state over all nodes (disabled: enabled = False)."""
    if store is None:
        return pb.RemoteStoreStats(enabled=False)
    health = store.health()
    return pb.RemoteStoreStats(enabled=True, mode=health.mode, breaker_state=health.state.value,
                               num_nodes=health.num_nodes, num_open_nodes=health.num_open_nodes,
                               num_errors=health.num_errors, num_breaker_opens=health.num_opened,
                               last_error=health.last_error, credentials_refused=health.credentials_refused)
