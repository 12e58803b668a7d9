"""A pool's part of the Stats response, from its TieringStats (tiering/tiering_stats.py), as proto."""

from __future__ import annotations

from kvtierd.node.pools import LayoutPool
from kvtierd.tiering.tiering_stats import TierUsage
from kvtierd.v1 import kvtier_pb2 as pb
from kvtierd.wire.conversions import layout_to_proto


def tier_message(usage: TierUsage) -> pb.TierStats:
    return pb.TierStats(tier=usage.tier, capacity_bytes=usage.capacity_bytes, used_bytes=usage.used_bytes,
                        num_cached_blocks=usage.num_cached_blocks, num_hit_blocks=usage.num_hit_blocks,
                        num_evictions=usage.num_evictions)


def pool_stats(pool: LayoutPool) -> pb.PoolStats:
    """The Stats message of one pool, from its tier manager's counters."""
    stats = pool.manager.stats()
    ssd = stats.ssd
    transfers = [pb.TransferStats(direction=direction, bytes_moved=stats.bytes_moved[direction],
                                  bytes_per_s=stats.bandwidth_bytes_per_s[direction])
                 for direction in sorted(stats.bytes_moved)]
    return pb.PoolStats(layout=layout_to_proto(pool.layout), num_blocks=stats.num_blocks,
                        num_free_blocks=stats.num_free_blocks, tiers=list(map(tier_message, stats.tiers)),
                        num_query_blocks=stats.num_query_blocks, transfers=transfers,
                        num_corrupted_blocks=ssd.num_corrupted_blocks if ssd else 0,
                        num_t2_io_errors=ssd.num_io_errors if ssd else 0,
                        num_failed_load_blocks=stats.num_failed_load_blocks,
                        num_failed_offload_blocks=stats.num_failed_offload_blocks,
                        t2_admitting=ssd.admitting if ssd else False, t2_reason=ssd.reason if ssd else "")
