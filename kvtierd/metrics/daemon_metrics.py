"""The daemon's Prometheus metrics (docs/architecture.md §9), on a registry of their own.

Three kinds of source:
- pushed by the daemon as things happen: RPC latency and outcome, sessions and the block
  references reclaimed from sessions that ended holding them;
- pushed by each block index through its observer (`index_observer`), under the index lock:
  block lifetime, idle-before-evict and reuse-gap histograms, and plain counters (query and
  hit tokens, T0 evictions) read at scrape time. Reuse-gap p90 above idle-before-evict p50
  means the pool is too small;
- read at scrape time from each pool's `TierManager.stats()` (`add_pool_source`, see
  metrics_collector.py): capacity, usage, hits, evictions and transfers per tier.
Every series carries the model (`model` label) where it belongs to one pool.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, start_http_server

from kvtierd.metrics.bucket_histogram import BucketHistogram
from kvtierd.metrics.metrics_collector import PoolSource, TierCollector

if TYPE_CHECKING:
    from kvtierd.node.quotas import Quota
    from kvtierd.t3.store_node import StoreHealth
    from kvtierd.tiering.tiering_stats import TieringStats

# Block ages: 1 ms (a block reused within one batch) to 1 h; older ones land in +Inf.
BLOCK_AGE_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                       60.0, 120.0, 300.0, 600.0, 1200.0, 1800.0, 3600.0)
# RPC latency: 50 µs (a lookup over a unix socket) to 10 s (a long Wait).
RPC_BUCKETS_S = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                 1.0, 2.5, 5.0, 10.0)


class PrometheusIndexObserver:
    """An IndexObserver (index_metrics.py) for one block index: plain counters and bucket
    histograms that a scrape reads (metrics_collector.py). Called under that index's lock, so
    nothing here needs a lock of its own: give each index its own observer."""

    __slots__ = ("num_query_tokens", "num_hit_tokens", "num_evictions", "lifetime_s", "idle_s", "reuse_gap_s")

    def __init__(self) -> None:
        self.num_query_tokens = 0
        self.num_hit_tokens = 0  # t0 only: lower-tier hits are counted by the pool
        self.num_evictions = 0  # t0 evictions
        self.lifetime_s = BucketHistogram(BLOCK_AGE_BUCKETS_S)
        self.idle_s = BucketHistogram(BLOCK_AGE_BUCKETS_S)
        self.reuse_gap_s = BucketHistogram(BLOCK_AGE_BUCKETS_S)

    def on_query(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        self.num_query_tokens += num_query_tokens
        self.num_hit_tokens += num_hit_tokens

    def on_evict(self, lifetimes_s: Sequence[float], idles_s: Sequence[float]) -> None:
        self.num_evictions += len(lifetimes_s)
        self.lifetime_s.observe_many(lifetimes_s)
        self.idle_s.observe_many(idles_s)

    def on_reuse(self, gaps_s: Sequence[float]) -> None:
        self.reuse_gap_s.observe_many(gaps_s)


class DaemonMetrics:
    """Every metric of one daemon, on `registry` (a new one by default; never the global one)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self._rpc_duration = Histogram(
            "kvtierd_rpc_duration_seconds", "Time to serve an RPC, by method and status code.",
            ["method", "code"], buckets=RPC_BUCKETS_S, registry=r)
        self._rpcs = Counter("kvtierd_rpc_total", "RPCs served, by method and status code.", ["method", "code"],
                             registry=r)
        self._sessions = Gauge("kvtierd_sessions", "Client sessions currently attached.", registry=r)
        self._sessions_reclaimed = Counter(
            "kvtierd_sessions_reclaimed_total",
            "Sessions that ended and whose state the daemon reclaimed, by why they ended.", ["reason"], registry=r)
        self._reclaimed_refs = Counter(
            "kvtierd_reclaimed_refs_total",
            "Block references released by the daemon on behalf of sessions that ended holding them.", registry=r)
        self._tiers = TierCollector()
        r.register(self._tiers)
        self._http = None  # (server, thread) while serve_http runs
        self._rpc_children: dict[tuple[str, str], tuple] = {}

    # ------------------------------------------------------------------------ block index

    def index_observer(self, model_id: str) -> PrometheusIndexObserver:
        """A new observer for one block index of `model_id` (pass it as TierManager(observer=...))."""
        observer = PrometheusIndexObserver()
        self._tiers.add_observer(model_id, observer)
        return observer

    # ------------------------------------------------------------------------ rpc, sessions

    def observe_rpc(self, method: str, code: str, seconds: float) -> None:
        children = self._rpc_children.get((method, code))
        if children is None:  # labels() takes a lock and a lookup: bind each pair once
            children = self._rpc_children[(method, code)] = (self._rpc_duration.labels(method, code),
                                                            self._rpcs.labels(method, code))
        children[0].observe(seconds)
        children[1].inc()

    def session_opened(self) -> None:
        self._sessions.inc()

    def session_closed(self, num_reclaimed_refs: int, reason: str) -> None:
        """A session ended (reason: "stream_closed", "lease_expired", "detached", ...) still
        holding `num_reclaimed_refs` block references, which the daemon released."""
        assert num_reclaimed_refs >= 0, num_reclaimed_refs
        self._sessions.dec()
        self._sessions_reclaimed.labels(reason).inc()
        self._reclaimed_refs.inc(num_reclaimed_refs)

    # ------------------------------------------------------------------------ pools

    def add_pool_source(self, model_id: str, block_size_tokens: int, bytes_per_block: int,
                        stats: Callable[[], TieringStats]) -> None:
        """Report a pool's tiers at every scrape from `stats()` (TierManager.stats()); replaces
        an earlier source of the same model."""
        assert block_size_tokens > 0 and bytes_per_block > 0, (block_size_tokens, bytes_per_block)  # from a Layout
        self._tiers.add_pool(model_id, PoolSource(block_size_tokens, bytes_per_block, stats))

    def add_store_source(self, health: Callable[[], StoreHealth]) -> None:
        """Report the node's shared store (T3) at every scrape from `health()` (RedisStore.health)."""
        self._tiers.store_health = health

    def add_tenant_source(self, usage_rows: Callable[[], list[dict]], quota_of: Callable[[str], Quota]) -> None:
        """Report per-tenant usage and quotas at every scrape (tenant_metrics.py)."""
        from kvtierd.metrics.tenant_metrics import TenantCollector

        self.registry.register(TenantCollector(usage_rows, quota_of))

    def remove_pool_source(self, model_id: str) -> None:
        """Stop reading the pool (call before closing it); unknown models are ignored."""
        self._tiers.remove_pool(model_id)

    # ------------------------------------------------------------------------ exposition

    def render(self) -> bytes:
        """The text exposition of every metric, as a scrape returns it."""
        return generate_latest(self.registry)

    def serve_http(self, host: str, port: int) -> tuple[WSGIServer, int]:
        """Serve /metrics on host:port (0: any free port) from a daemon thread; returns
        (server, bound port)."""
        if self._http is not None:
            raise RuntimeError("metrics HTTP server already running")
        started = start_http_server(port, addr=host, registry=self.registry)
        if started is None:  # prometheus_client < 0.17 returned nothing to stop
            raise RuntimeError("prometheus_client too old: start_http_server must return (server, thread)")
        self._http = started
        server = started[0]
        return server, server.server_port

    def close(self) -> None:
        """Stop the HTTP server, if any. Idempotent."""
        if self._http is None:
            return
        server, thread = self._http
        self._http = None
        server.shutdown()
        server.server_close()
        thread.join()
