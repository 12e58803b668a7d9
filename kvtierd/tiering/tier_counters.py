"""The monotonic counters of one layout's tiers, as an operator reads them (tiering_stats.py).

One method per counter, each typed by what it counts (a Tier, an Edge, a copy Direction); any
thread may call them (each takes the lock). The rules of what counts as a query, a hit or a miss
are in the callers' module docstrings (promotion.py, block_io.py, remote_stream.py,
index/query_counting.py); the fields are read without the lock (each a whole value).
"""

from __future__ import annotations

import dataclasses
import threading

from kvtierd.movers.copy_engine import Direction
from kvtierd.tier import Edge, Tier, TierCounts


@dataclasses.dataclass
class TierCounters:
    """Counts since start; written only through the `count_*` methods."""

    num_query_blocks: int = 0  # asked for by Acquire, Put and Get or named by a Lookup: the hit rate's denominator
    # hits of queries, by the tier that held them: a Lookup's promise, or what an Acquire, Put or Get served
    num_hit_blocks: TierCounts = TierCounts()
    # lower-tier hits of queries declined, by the tier that held them: recompute was expected faster
    num_skipped_slow_blocks: TierCounts = TierCounts()
    # promotions that failed (recomputed): never a hit of their Acquire; a Lookup's promise stays counted
    num_failed_load_blocks: int = 0
    num_offloaded_blocks: dict[Edge, int] = dataclasses.field(  # by edge; into T3: queued for the store's writer
        default_factory=lambda: dict.fromkeys(Edge, 0))
    num_failed_offload_blocks: int = 0
    # blocks an edge into T1 or T2 did not copy down, by edge: no room below (write-through after waiting
    # policy.write_through_wait_s; an eviction at once) or the tier below refused them; into T3: its own count
    num_dropped_offload_blocks: dict[Edge, int] = dataclasses.field(
        default_factory=lambda: dict.fromkeys(Edge, 0))
    bytes_moved: dict[str, int] = dataclasses.field(  # by copy direction (its value): this layout's copies that landed
        default_factory=lambda: dict.fromkeys((d.value for d in Direction), 0))
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)

    def count_queries(self, num_blocks: int) -> None:
        with self.lock:
            self.num_query_blocks += num_blocks

    def count_hits(self, tier: Tier, num_blocks: int) -> None:
        if num_blocks:
            with self.lock:
                self.num_hit_blocks += TierCounts.of(tier, num_blocks)

    def count_skipped_slow(self, declined: TierCounts) -> None:
        if declined.num_blocks:
            with self.lock:
                self.num_skipped_slow_blocks += declined

    def count_failed_loads(self, num_blocks: int) -> None:
        with self.lock:
            self.num_failed_load_blocks += num_blocks

    def count_offloaded(self, edge: Edge, num_blocks: int) -> None:
        with self.lock:
            self.num_offloaded_blocks[edge] += num_blocks

    def count_failed_offloads(self, num_blocks: int) -> None:
        with self.lock:
            self.num_failed_offload_blocks += num_blocks

    def count_dropped_offloads(self, edge: Edge, num_blocks: int) -> None:
        if num_blocks:
            with self.lock:
                self.num_dropped_offload_blocks[edge] += num_blocks

    def count_moved(self, direction: Direction, nbytes: int) -> None:
        with self.lock:
            self.bytes_moved[direction.value] += nbytes
