"""The scrape-time half of the daemon's metrics: tier state read from each pool when scraped.

Each registered pool is a `PoolSource` whose `stats()` returns `TierManager.stats()`; index
observers hold plain counters (prefix query and hit tokens, T0 evictions) that the index bumps
under its own lock. At scrape time `TierCollector` reads both and builds fresh metric families,
so nothing is copied on the hot path and a removed pool simply stops being reported. Families
that mix the two sources (hit tokens and evictions per tier) live here only: one name, one
collector.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from kvtierd.index.residency import RESIDENCY_BUCKETS_S
from kvtierd.metrics.bucket_histogram import BucketHistogram
from kvtierd.tier import Edge, Tier

if TYPE_CHECKING:
    from kvtierd.t3.store_node import StoreHealth
    from kvtierd.tiering.tiering_stats import TieringStats

log = logging.getLogger(__name__)

# One scrape's metric families by key. Their add_metric differ (a histogram's takes buckets and a
# sum, prometheus_client's Metric has none): _FAMILIES and _AGE_HISTOGRAMS fix each key's kind.
Families = dict[str, Any]


class IndexCounts(Protocol):
    """What an index observer has counted so far (monotonic)."""

    num_query_tokens: int
    num_hit_tokens: int
    num_evictions: int
    lifetime_s: BucketHistogram
    idle_s: BucketHistogram
    reuse_gap_s: BucketHistogram


# observer attribute → (name, help) of the per-model block-age histograms
_AGE_HISTOGRAMS = {
    "lifetime_s": ("kvtierd_block_lifetime_seconds", "Time from a T0 block's commit to its eviction."),
    "idle_s": ("kvtierd_block_idle_before_evict_seconds", "Time from a T0 block's last release to its eviction."),
    "reuse_gap_s": ("kvtierd_block_reuse_gap_seconds",
                    "Time from a T0 block's last release to its reuse by a prefix hit (hits on blocks in use "
                    "not counted)."),
}


@dataclasses.dataclass(frozen=True, slots=True)
class PoolSource:
    block_size_tokens: int
    bytes_per_block: int
    stats: Callable[[], TieringStats]  # TierManager.stats(); called on the scrape thread


# attribute → (family kind, name without _total, help, labels after "model")
_FAMILIES: dict[str, tuple[type, str, str, tuple[str, ...]]] = {
    "query_tokens": (CounterMetricFamily, "kvtierd_prefix_query_tokens",
                     "Prompt tokens of prefix queries, full blocks only (an engine's Lookup that names its query, "
                     "else the Acquire, Put or Get), each counted once.", ()),
    "hit_tokens": (CounterMetricFamily, "kvtierd_prefix_hit_tokens",
                   "Prompt tokens of queries served from a tier instead of recomputed, by the tier that held them "
                   "(counted where the query is: a Lookup's promise, else the load).", ("tier",)),
    "hit_blocks": (CounterMetricFamily, "kvtierd_prefix_hit_blocks", "Prefix blocks of queries served from each "
                   "tier (as kvtierd_prefix_hit_tokens).", ("tier",)),
    "evictions": (CounterMetricFamily, "kvtierd_evictions", "Cached blocks evicted from each tier.", ("tier",)),
    "capacity": (GaugeMetricFamily, "kvtierd_tier_capacity_bytes", "Bytes each tier can hold.", ("tier",)),
    "fair_share": (GaugeMetricFamily, "kvtierd_tier_fair_share_bytes",
                   "What this model is guaranteed of the node's T1 / T2 budget now (the budget over the models "
                   "that use the tier); kvtierd_tier_capacity_bytes is what it holds, above the share while "
                   "others leave room.", ("tier",)),
    "used": (GaugeMetricFamily, "kvtierd_tier_used_bytes",
             "Bytes in use per tier (t0: blocks held by requests; t1, t2: stored blocks).", ("tier",)),
    "t0_free_blocks": (GaugeMetricFamily, "kvtierd_t0_free_blocks",
                       "Device pool blocks not held by any request (cached ones included); a steady fall "
                       "with steady traffic is a reference leak.", ()),
    "t0_blocks": (GaugeMetricFamily, "kvtierd_t0_blocks", "Blocks in the device pool.", ()),
    "cached_blocks": (GaugeMetricFamily, "kvtierd_cached_blocks",
                      "Blocks holding reusable content (t0: in the index; t2: on the SSD).", ("tier",)),
    "transfer_bytes": (CounterMetricFamily, "kvtierd_transfer_bytes",
                       "Bytes this model's copies moved per direction (d2h: device to host, h2d: host to device, "
                       "h2h: host to host); the node's total is the sum over models.", ("direction",)),
    "bandwidth": (GaugeMetricFamily, "kvtierd_transfer_bandwidth_bytes_per_second",
                  "Measured copy bandwidth per direction of the device's copy engine, shared by the models on "
                  "the device (the same in each: average, never add up).", ("direction",)),
    "offloaded_blocks": (CounterMetricFamily, "kvtierd_offloaded_blocks", "Blocks copied down each tier edge.",
                         ("edge",)),
    "failed_loads": (CounterMetricFamily, "kvtierd_failed_loads",
                     "Blocks whose promotion from a lower tier failed (served as misses).", ()),
    "failed_offloads": (CounterMetricFamily, "kvtierd_failed_offloads", "Blocks whose copy down a tier failed.", ()),
    "retention_downgraded": (CounterMetricFamily, "kvtierd_retention_downgraded_blocks",
                             "Times a hinted block was kept without its hint, over the tenant's quota of a tier: "
                             "when the hint was set, and each time such a block entered a tier's eviction order or "
                             "gave its room to a stronger hint (a block may count more than once).", ()),
    "dropped_offloads": (CounterMetricFamily, "kvtierd_dropped_offload_blocks",
                         "Blocks an edge into T1 or T2 did not copy down: no slot free of copies in flight within "
                         "policy.write_through_wait_s (an eviction cannot wait), or T2 refused them.", ("edge",)),
    "skipped_slow": (CounterMetricFamily, "kvtierd_skipped_slow_blocks",
                     "Lower-tier hits of queries not loaded because recomputing them was expected to be faster, "
                     "by the tier that held them.", ("tier",)),
    "recompute": (GaugeMetricFamily, "kvtierd_recompute_seconds_per_token",
                  "The cost a lower-tier hit must beat to be loaded: seconds to recompute a prompt token, as the "
                  "engines measure it or policy.recompute_s_per_token sets it (0: unknown, every hit loads).", ()),
    "ssd_dropped": (CounterMetricFamily, "kvtierd_ssd_corrupted_blocks_dropped",
                    "SSD blocks dropped as corrupt, on read or when the tier was opened.", ()),
    "ssd_io_errors": (CounterMetricFamily, "kvtierd_ssd_io_errors", "SSD read or write errors.", ()),
    "ssd_unauthentic": (CounterMetricFamily, "kvtierd_ssd_unauthentic_blocks",
                        "Sealed SSD blocks dropped on read because they did not open as their own key's (moved, "
                        "altered, or of a forgotten tenant); never served.", ()),
    "ssd_admitting": (GaugeMetricFamily, "kvtierd_ssd_admitting",
                      "1 while the SSD tier accepts new blocks, 0 after it stopped (disk full, I/O error).", ()),
    "t3_hits": (CounterMetricFamily, "kvtierd_t3_hit_blocks", "Blocks read from the shared store, verified and "
                "loaded.", ()),
    "t3_misses": (CounterMetricFamily, "kvtierd_t3_miss_blocks",
                  "Blocks of a query (Acquire, Get, Lookup with num_query_blocks) asked of the shared store and "
                  "not loaded, once each: absent, on a node down or behind an open breaker, dropped, refused.", ()),
    "t3_corrupt": (CounterMetricFamily, "kvtierd_t3_corrupt_blocks",
                   "Shared-store values refused by the frame check (another layout or chain, short, bad checksum) "
                   "or, sealed, because they did not open (kvtierd_t3_unauthentic_blocks).",
                   ()),
    "t3_unauthentic": (CounterMetricFamily, "kvtierd_t3_unauthentic_blocks",
                       "Sealed shared-store values refused because they did not open as their own key's (moved, "
                       "another tenant's, altered, or their tenant's key forgotten or wrapped by another master "
                       "key); among kvtierd_t3_corrupt_blocks, never served.", ()),
    "t3_read_bytes": (CounterMetricFamily, "kvtierd_t3_read_bytes", "Value bytes read from the shared store.", ()),
    "t3_written_bytes": (CounterMetricFamily, "kvtierd_t3_written_bytes", "Value bytes the shared store took.", ()),
    "t3_written": (CounterMetricFamily, "kvtierd_t3_written_blocks", "Blocks the shared store took.", ()),
    "t3_failed_writes": (CounterMetricFamily, "kvtierd_t3_failed_writes",
                         "Writes the shared store did not take (a node failed or its breaker was open).", ()),
    "t3_dropped_writes": (CounterMetricFamily, "kvtierd_t3_dropped_writes",
                          "Writes dropped because the bounded write backlog was full.", ()),
    "lookup_tokens": (CounterMetricFamily, "kvtierd_lookup_tokens",
                      "Prompt tokens of queries (as kvtierd_prefix_query_tokens) by the tier that served them, "
                      "'miss' for those no tier served (recomputed, declined hits included): the labels add up "
                      "to the queried tokens.", ("tier",)),
    "blocks_left": (CounterMetricFamily, "kvtierd_blocks_left",
                    "Blocks that left a tier, by why: evicted (for room, not copied down), demoted (sent down "
                    "to the tier below), expired (its retention hint lapsed), flushed (an operator's evict, "
                    "flush or forget, a reset, a corrupt block).", ("tier", "reason")),
    "hit_rate": (GaugeMetricFamily, "kvtierd_hit_rate",
                 "Query tokens served from any tier over query tokens, since start.", ()),
    "unbounded_hit_rate": (GaugeMetricFamily, "kvtierd_unbounded_hit_rate",
                           "The hit rate a cache without a size limit would have had on the same queries since "
                           "start: every query token but the first sight of each distinct block stored.", ()),
    "distinct_blocks": (GaugeMetricFamily, "kvtierd_distinct_blocks_stored",
                        "Distinct blocks ever committed into the device pool since start (HyperLogLog estimate, "
                        "0.8 % standard error).", ()),
    "t3_backlog": (GaugeMetricFamily, "kvtierd_t3_write_backlog_bytes", "Bytes queued or in flight to the shared "
                   "store.", ()),
}
# The node's shared store, no model label: name → (family kind, help)
_STORE_FAMILIES: dict[str, tuple[type, str]] = {
    "kvtierd_t3_breaker_open": (GaugeMetricFamily, "1 while any shared-store node's circuit breaker is open (its "
                                "keys are misses), else 0."),
    "kvtierd_t3_open_nodes": (GaugeMetricFamily, "Shared-store nodes not answering: circuit breaker open or "
                              "half-open, or the node's last call (a request or the periodic probe) failed."),
    "kvtierd_t3_nodes": (GaugeMetricFamily, "Shared-store nodes known from the slot table."),
    "kvtierd_t3_up": (GaugeMetricFamily, "1 while every shared-store node answers, else 0."),
    "kvtierd_t3_credentials_refused": (GaugeMetricFamily, "1 while the shared store refuses the daemon's "
                                       "credentials (remote.username / remote.password_file), else 0."),
    "kvtierd_t3_errors": (CounterMetricFamily, "Calls to a shared-store node that failed."),
}


class TierCollector:
    """A prometheus_client collector over the registered pools and index observers. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # guards the two dicts below, never held while calling stats()
        self._pools: dict[str, PoolSource] = {}
        self._observers: dict[str, list[IndexCounts]] = {}
        self.store_health: Callable[[], StoreHealth] | None = None  # RedisStore.health of the node's T3, if any

    def add_pool(self, model_id: str, source: PoolSource) -> None:
        with self._lock:
            self._pools[model_id] = source

    def remove_pool(self, model_id: str) -> None:
        with self._lock:
            self._pools.pop(model_id, None)

    def add_observer(self, model_id: str, observer: IndexCounts) -> None:
        """Observers are kept for good: their counters must not go back when a pool is reopened."""
        with self._lock:
            self._observers.setdefault(model_id, []).append(observer)

    def describe(self) -> list[Metric]:
        return list(_new_families().values()) + (self._store_metrics() if self.store_health else [])

    def _store_metrics(self) -> list[Metric]:
        families = {name: kind(name, help_text) for name, (kind, help_text) in _STORE_FAMILIES.items()}
        if self.store_health is not None:
            health = self.store_health()
            families["kvtierd_t3_breaker_open"].add_metric([], 1 if health.state.value == "open" else 0)
            families["kvtierd_t3_open_nodes"].add_metric([], health.num_open_nodes)
            families["kvtierd_t3_nodes"].add_metric([], health.num_nodes)
            families["kvtierd_t3_up"].add_metric([], 1 if health.serving else 0)
            families["kvtierd_t3_credentials_refused"].add_metric([], 1 if health.credentials_refused else 0)
            families["kvtierd_t3_errors"].add_metric([], health.num_errors)
        return list(families.values())

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            pools = sorted(self._pools.items())
            observers = sorted((model, list(found)) for model, found in self._observers.items())
        families = _new_families()
        for model, found in observers:
            families["query_tokens"].add_metric([model], sum(o.num_query_tokens for o in found))
            families["hit_tokens"].add_metric([model, Tier.T0], sum(o.num_hit_tokens for o in found))
            families["evictions"].add_metric([model, Tier.T0], sum(o.num_evictions for o in found))
            for attribute in _AGE_HISTOGRAMS:
                histograms = [getattr(o, attribute) for o in found]
                total = histograms[0].cumulative()
                for other in histograms[1:]:
                    total = [(le, a + b) for (le, a), (_, b) in zip(total, other.cumulative())]
                families[attribute].add_metric([model], total, sum_value=sum(h.sum for h in histograms))
        for model, source in pools:
            try:
                stats = source.stats()
            except Exception:  # a pool closing under the scrape must not fail the whole scrape
                log.exception("stats of pool %r failed; left out of this scrape", model)
                continue
            _add_pool(families, model, source, stats)
        yield from families.values()
        if self.store_health is not None:
            yield from self._store_metrics()


def _new_families() -> Families:
    families = {key: kind(name, help_text, labels=("model", *labels))
                for key, (kind, name, help_text, labels) in _FAMILIES.items()}
    families.update({key: HistogramMetricFamily(name, help_text, labels=("model",))
                     for key, (name, help_text) in _AGE_HISTOGRAMS.items()})
    families["residency"] = HistogramMetricFamily(
        "kvtierd_block_residency_seconds", "Time a block stayed in a tier, from entering it (t0: its commit; t1, "
        "t2: its store) to leaving it, by why it left (as kvtierd_blocks_left_total).",
        labels=("model", "tier", "reason"))
    return families


def _add_residency(families: Families, model: str, stats: TieringStats) -> None:
    bounds = [floatToGoString(bound) for bound in RESIDENCY_BUCKETS_S] + ["+Inf"]
    for tier, snapshot in stats.residency.items():
        for reason, counts in snapshot.by_reason.items():
            families["blocks_left"].add_metric([model, tier, reason], counts.num_blocks)
            cumulative = list(zip(bounds, itertools.accumulate(counts.bucket_counts)))
            families["residency"].add_metric([model, tier, reason], cumulative, sum_value=counts.sum_s)


def _add_served(families: Families, model: str, source: PoolSource, stats: TieringStats) -> None:
    served = stats.num_served_blocks
    for tier, num_blocks in (*served.items(), ("miss", stats.num_miss_blocks)):
        families["lookup_tokens"].add_metric([model, tier], num_blocks * source.block_size_tokens)
    families["hit_rate"].add_metric([model], stats.hit_rate)
    families["unbounded_hit_rate"].add_metric([model], stats.unbounded_hit_rate)
    families["distinct_blocks"].add_metric([model], stats.num_distinct_blocks)


def _add_pool(families: Families, model: str, source: PoolSource, stats: TieringStats) -> None:
    def add(key: str, value: float, *labels: str) -> None:
        families[key].add_metric([model, *labels], value)

    add("t0_free_blocks", stats.num_free_blocks)
    add("t0_blocks", stats.num_blocks)
    for usage in stats.tiers:
        add("capacity", usage.capacity_bytes, usage.tier)
        if usage.tier != Tier.T0:
            add("fair_share", usage.fair_share_bytes, usage.tier)
        add("used", usage.used_bytes, usage.tier)
        add("cached_blocks", usage.num_cached_blocks, usage.tier)
        add("hit_blocks", usage.num_hit_blocks, usage.tier)
        if usage.tier != Tier.T0:  # t0 hit tokens and evictions come from the index observer
            add("hit_tokens", usage.num_hit_blocks * source.block_size_tokens, usage.tier)
            add("evictions", usage.num_evictions, usage.tier)
            add("skipped_slow", stats.num_skipped_slow_blocks[usage.tier], usage.tier)  # T0's hits are always taken
    if (ssd := stats.ssd) is not None:
        add("ssd_dropped", ssd.num_corrupted_blocks + ssd.num_dropped_on_open)
        add("ssd_io_errors", ssd.num_io_errors)
        add("ssd_unauthentic", ssd.num_unauthentic_blocks)
        add("ssd_admitting", 1 if ssd.admitting else 0)
    for direction, nbytes in stats.bytes_moved.items():
        add("transfer_bytes", nbytes, direction)
    for direction, bytes_per_s in stats.bandwidth_bytes_per_s.items():
        add("bandwidth", bytes_per_s, direction)
    for edge, num_blocks in stats.num_offloaded_blocks.items():
        add("offloaded_blocks", num_blocks, edge)
    for edge in (Edge.T0_T1, Edge.T1_T2):  # into T3: kvtierd_t3_dropped_writes
        add("dropped_offloads", stats.num_dropped_offload_blocks[edge], edge)
    if (t3 := stats.t3) is not None:
        add("hit_blocks", stats.num_t3_hit_blocks, Tier.T3)  # of queries; kvtierd_t3_hit_blocks: the store's reads
        add("hit_tokens", stats.num_t3_hit_blocks * source.block_size_tokens, Tier.T3)
        add("skipped_slow", stats.num_skipped_slow_blocks.t3, Tier.T3)
        for key, value in (("t3_hits", t3.num_hit_blocks), ("t3_misses", t3.num_miss_blocks),
                           ("t3_corrupt", t3.num_corrupt_blocks), ("t3_unauthentic", t3.num_unauthentic_blocks),
                           ("t3_read_bytes", t3.read_bytes),
                           ("t3_written_bytes", t3.written_bytes), ("t3_written", t3.num_written_blocks),
                           ("t3_failed_writes", t3.num_failed_writes), ("t3_dropped_writes", t3.num_dropped_writes),
                           ("t3_backlog", t3.write_backlog_bytes)):
            add(key, value)
    add("failed_loads", stats.num_failed_load_blocks)
    add("failed_offloads", stats.num_failed_offload_blocks)
    add("retention_downgraded", stats.num_retention_downgraded_blocks)
    add("recompute", stats.recompute.s_per_token or 0.0)
    _add_residency(families, model, stats)
    _add_served(families, model, source, stats)
