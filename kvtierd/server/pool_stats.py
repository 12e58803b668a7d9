"""A pool's part of the Stats response: tiers, queries, transfers and T2 errors, as proto."""

from __future__ import annotations

from kvtierd.node.pools import Pool
from kvtierd.v1 import kvtier_pb2 as pb
from kvtierd.wire.conversions import layout_to_proto


def pool_stats(pool: Pool) -> pb.PoolStats:
    """The Stats message of one pool, from its tier manager's counters."""
    stats = pool.manager.stats()
    t0 = stats["t0"]
    bytes_per_block = pool.layout.bytes_per_block
    hits = stats["hit_blocks"]
    tiers = [pb.TierStats(tier="t0", capacity_bytes=t0["capacity_bytes"],
                          used_bytes=(t0["num_blocks"] - t0["num_free_blocks"]) * bytes_per_block,
                          num_cached_blocks=t0["num_cached_blocks"], num_hit_blocks=hits["t0"],
                          num_evictions=t0["evictions"])]
    if "t1" in stats:
        t1 = stats["t1"]
        tiers.append(pb.TierStats(tier="t1", capacity_bytes=t1["capacity_bytes"], used_bytes=t1["used_bytes"],
                                  num_cached_blocks=pool.manager.tiers.host.index.num_ready,
                                  num_hit_blocks=hits["t1"], num_evictions=t1["evictions"]))
    if "t2" in stats:
        t2 = stats["t2"]
        tiers.append(pb.TierStats(tier="t2", capacity_bytes=t2["capacity_bytes"], used_bytes=t2["used_bytes"],
                                  num_cached_blocks=t2["num_entries"], num_hit_blocks=hits["t2"],
                                  num_evictions=t2["num_evictions"]))
    t2 = stats.get("t2", {})
    transfers = [pb.TransferStats(direction=direction, bytes_moved=stats["bytes_moved"][direction],
                                  bytes_per_s=stats["bandwidth_bytes_per_s"][direction])
                 for direction in sorted(stats["bytes_moved"])]
    return pb.PoolStats(layout=layout_to_proto(pool.layout), num_blocks=t0["num_blocks"],
                        num_free_blocks=t0["num_free_blocks"], tiers=tiers, num_query_blocks=stats["query_blocks"],
                        transfers=transfers, num_corrupted_blocks=t2.get("num_corrupted", 0),
                        num_t2_io_errors=t2.get("num_io_errors", 0),
                        num_failed_load_blocks=stats["failed_load_blocks"],
                        num_failed_offload_blocks=stats["failed_offload_blocks"],
                        t2_admitting=t2.get("admitting", False), t2_reason=t2.get("reason") or "")
