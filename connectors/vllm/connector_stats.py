"""The connector's own metrics inside vLLM: what it loaded per tier, failed to load, stored,
dropped, the bytes it moved, its store RPCs, its retention hints (refused, and the blocks the daemon
retained or downgraded) and its lookup latency, on vLLM's /metrics and in its periodic
"KV Transfer metrics" log line.

vLLM 0.32's path (vllm/distributed/kv_transfer/kv_connector/v1/base.py and metrics.py): every
worker's `get_kv_connector_stats()` after each step, aggregated over workers
(vllm/distributed/kv_transfer/kv_connector/utils.py, KVOutputAggregator) and with the scheduler
side's own (vllm/v1/core/sched/scheduler.py, update_from_output), reaches the API server as
`to_dict()`; there `build_kv_connector_stats(data)` rebuilds it for the log line and
`build_prom_metrics(...)`'s `observe(data, engine_idx)` adds it to Prometheus counters labelled
per engine as vLLM's own. So `data` holds only ints and a list of floats (it crosses processes),
and each report is what happened since the previous one (the counters add deltas).

The counts are the connector's, not vLLM's prefix cache's: they are the same with vLLM's prefix
cache on or off. Tokens are counted by TP rank 0 only (every rank loads the same tokens, each
its own shard of their bytes); bytes, blocks and RPCs by every rank. Declined tokens are counted
by the scheduler, once per request's first lookup of its positions: the daemon held them after
the hit but loading them was expected to be slower than vLLM recomputing them (the first rank's
first full-attention group, by the tier that held them).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

from prometheus_client import Counter, Histogram

from kvtierd.tier import Tier, TierCounts
from kvtierd.token_bytes import packed_size

TIERS = tuple(tier.value for tier in Tier)  # "t0" .. "t3": the keys and label values of the counts below
LOADED_TOKENS = tuple(f"loaded_tokens_{tier}" for tier in TIERS)  # loaded into vLLM, by the tier that held them
LOWER_TIERS = TIERS[1:]  # T0's hits are never declined
DECLINED_TOKENS = tuple(f"declined_tokens_{tier}" for tier in LOWER_TIERS)  # held, recomputed as faster, by tier
COUNTS = (*LOADED_TOKENS, *DECLINED_TOKENS,
          "failed_load_blocks",  # planned loads vLLM recomputes (evicted, the daemon gone, a failed copy)
          "stored_blocks",  # new blocks committed to the daemon
          "dropped_stores",  # stores given up (the daemon down or full, a lost parent)
          "loaded_bytes", "stored_bytes",  # KV bytes copied between vLLM's pages and the pool
          "store_rpcs",  # Acquire, Commit and Release calls of the stores
          "store_request_bytes",  # the hashes and token ids (u32) those calls carried
          "attach_failures",  # tries to attach that failed: the daemon unreachable, vLLM serves without it
          "refused_retention_hints",  # hints not sent: malformed (the scheduler), refused by the daemon (a worker)
          "retained_blocks",  # blocks the daemon answered a hint now covers (a Commit's, a Retain's)
          "downgraded_retention_blocks")  # blocks it kept without the hint (the tenant's retention quota)
LOOKUP_SECONDS = "lookup_seconds"  # one float per Lookup RPC round trip (the scheduler's)
LOOKUP_BUCKETS_S = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0)

try:  # vLLM is optional (as in connector.py)
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
except ImportError:
    if not TYPE_CHECKING:  # pyright checks this package with vLLM installed (the vllm lane)
        import dataclasses

        @dataclasses.dataclass
        class KVConnectorStats:
            """Stands in for vLLM's base class where vLLM is not installed (the unit tests)."""

            data: dict[str, Any] = dataclasses.field(default_factory=dict)

            def to_dict(self) -> dict[str, Any]:
                return self.data

        class KVConnectorPromMetrics:
            def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> None:
                self._counter_cls = metric_types[Counter]
                self._histogram_cls = metric_types[Histogram]
                self._labelnames = labelnames
                self.per_engine_labelvalues = per_engine_labelvalues


class KvtierdConnectorStats(KVConnectorStats):
    """A report: `data` maps each of COUNTS to an int and LOOKUP_SECONDS to a list of floats
    (keys may be missing: zero, none)."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KvtierdConnectorStats:
        """This report plus `other`'s (another worker's, the scheduler's, a later interval's)."""
        for key in COUNTS:
            if other.data.get(key):
                self.data[key] = self.data.get(key, 0) + other.data[key]
        if other.data.get(LOOKUP_SECONDS):
            self.data[LOOKUP_SECONDS] = [*self.data.get(LOOKUP_SECONDS, ()), *other.data[LOOKUP_SECONDS]]
        return self

    def reduce(self) -> dict[str, int | float]:
        """The log line's figures: the counts, and the lookups' number and mean milliseconds."""
        figures: dict[str, int | float] = {key: self.data[key] for key in COUNTS if self.data.get(key)}
        lookups = self.data.get(LOOKUP_SECONDS) or []
        if lookups:
            figures["lookups"] = len(lookups)
            figures["lookup_mean_ms"] = round(1e3 * sum(lookups) / len(lookups), 3)
        return figures

    def is_empty(self) -> bool:
        return not any(self.data.get(key) for key in (*COUNTS, LOOKUP_SECONDS))


class StatsRecorder:
    """What one side of the connector counted since its last report; added to from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}
        self._lookup_seconds: list[float] = []

    def add(self, key: str, count: int) -> None:
        assert key in COUNTS, key
        if count:
            with self._lock:
                self._counts[key] = self._counts.get(key, 0) + count

    def add_loaded_tokens(self, loaded_blocks: TierCounts, block_size: int) -> None:
        """Blocks loaded into vLLM, by the tier that held them."""
        for key, num_blocks in zip(LOADED_TOKENS, loaded_blocks):
            self.add(key, num_blocks * block_size)

    def add_declined_tokens(self, declined_blocks: TierCounts, block_size: int) -> None:
        """Blocks the daemon held but declined as slower to load than to recompute, by tier."""
        for key, tier in zip(DECLINED_TOKENS, LOWER_TIERS):
            self.add(key, declined_blocks[tier] * block_size)

    def observe_lookup(self, seconds: float) -> None:
        with self._lock:
            self._lookup_seconds.append(seconds)

    def take(self) -> KvtierdConnectorStats | None:
        """The report since the last one (None when nothing happened), and start a new one."""
        with self._lock:
            counts, self._counts = self._counts, {}
            lookups, self._lookup_seconds = self._lookup_seconds, []
        if not counts and not lookups:
            return None
        return KvtierdConnectorStats(data={**counts, **({LOOKUP_SECONDS: lookups} if lookups else {})})


class KvtierdPromMetrics(KVConnectorPromMetrics):
    """vLLM's Prometheus counters for the connector, per engine (vLLM's labels), loads by tier:
    vllm:kvtierd_loaded_tokens_total{tier}, vllm:kvtierd_declined_slow_tokens_total{tier},
    vllm:kvtierd_failed_load_blocks_total,
    vllm:kvtierd_stored_blocks_total, vllm:kvtierd_dropped_stores_total,
    vllm:kvtierd_bytes_total{direction="load"|"store"}, vllm:kvtierd_store_rpcs_total,
    vllm:kvtierd_store_request_bytes_total, vllm:kvtierd_attach_failures_total,
    vllm:kvtierd_refused_retention_hints_total, vllm:kvtierd_retained_blocks_total,
    vllm:kvtierd_downgraded_retention_blocks_total and the histogram vllm:kvtierd_lookup_seconds."""

    def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        counter, histogram = self._counter_cls, cast("type[Histogram]", self._histogram_cls)
        loaded = counter(name="vllm:kvtierd_loaded_tokens", labelnames=[*labelnames, "tier"],
                         documentation="Prompt tokens kvtierd loaded into vLLM, by the daemon tier that held them.")
        declined = counter(name="vllm:kvtierd_declined_slow_tokens", labelnames=[*labelnames, "tier"],
                           documentation="Prompt tokens kvtierd held but did not load, because vLLM recomputing "
                                         "them was expected to be faster, by the daemon tier that held them.")
        moved = counter(name="vllm:kvtierd_bytes", labelnames=[*labelnames, "direction"],
                        documentation="KV bytes copied between vLLM's pages and kvtierd's pool (all TP ranks).")
        plain = {
            "failed_load_blocks": counter(name="vllm:kvtierd_failed_load_blocks", labelnames=labelnames,
                                          documentation="Planned kvtierd loads vLLM recomputed instead (blocks)."),
            "stored_blocks": counter(name="vllm:kvtierd_stored_blocks", labelnames=labelnames,
                                     documentation="New blocks vLLM stored in kvtierd."),
            "dropped_stores": counter(name="vllm:kvtierd_dropped_stores", labelnames=labelnames,
                                      documentation="Stores given up (daemon down or full, a lost parent)."),
            "store_rpcs": counter(name="vllm:kvtierd_store_rpcs", labelnames=labelnames,
                                  documentation="Acquire, Commit and Release calls of vLLM's stores."),
            "store_request_bytes": counter(name="vllm:kvtierd_store_request_bytes", labelnames=labelnames,
                                           documentation="Block hashes and token ids those calls carried (bytes)."),
            "attach_failures": counter(name="vllm:kvtierd_attach_failures", labelnames=labelnames,
                                       documentation="Tries to attach to kvtierd that failed (the daemon "
                                                     "unreachable or refusing); vLLM serves without the cache."),
            "refused_retention_hints": counter(
                name="vllm:kvtierd_refused_retention_hints", labelnames=labelnames,
                documentation="Retention hints in kv_transfer_params not sent: malformed (once per request) or "
                              "refused by kvtierd (once per request and TP rank); the requests are served without."),
            "retained_blocks": counter(name="vllm:kvtierd_retained_blocks", labelnames=labelnames,
                                       documentation="Blocks kvtierd answered a retention hint now covers (each "
                                                     "Commit's and Retain's answer, all TP ranks)."),
            "downgraded_retention_blocks": counter(
                name="vllm:kvtierd_downgraded_retention_blocks", labelnames=labelnames,
                documentation="Blocks kvtierd kept without their retention hint (the tenant's retention quota)."),
        }
        lookup = histogram(name="vllm:kvtierd_lookup_seconds", labelnames=labelnames, buckets=list(LOOKUP_BUCKETS_S),
                           documentation="Round trip of the scheduler's Lookup RPCs to kvtierd.")
        self._counters: dict[int, dict[str, Any]] = {}
        self._lookups: dict[int, Any] = {}
        for engine, values in per_engine_labelvalues.items():
            children = {key: metric.labels(*values) for key, metric in plain.items()}
            children.update({key: loaded.labels(*values, tier) for key, tier in zip(LOADED_TOKENS, TIERS)})
            children.update({key: declined.labels(*values, tier) for key, tier in zip(DECLINED_TOKENS, LOWER_TIERS)})
            children["loaded_bytes"] = moved.labels(*values, "load")
            children["stored_bytes"] = moved.labels(*values, "store")
            self._counters[engine] = children
            self._lookups[engine] = lookup.labels(*values)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        counters = self._counters[engine_idx]
        for key in COUNTS:
            if transfer_stats_data.get(key):
                counters[key].inc(transfer_stats_data[key])
        for seconds in transfer_stats_data.get(LOOKUP_SECONDS) or ():
            self._lookups[engine_idx].observe(seconds)


def request_payload_nbytes(block_hashes: Sequence[bytes], token_ids: Sequence[int]) -> int:
    """The bytes of hashes and token ids (u32) a request carries: what a store sends besides the ids."""
    return sum(map(len, block_hashes)) + packed_size(len(token_ids))
