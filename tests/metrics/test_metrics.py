"""DaemonMetrics: what a scrape reports equals what the tiers and the index report, and promtool
accepts the exposition (names, units, suffixes, help texts), rendered and served over HTTP."""

from __future__ import annotations

import pathlib
import subprocess
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvtierd.block_hash import Namespace
from kvtierd.layout import Layout
from kvtierd.metrics.daemon_metrics import DaemonMetrics
from kvtierd.t2.ssd_config import SsdTierConfig
from kvtierd.tiering.tier_config import TierConfig
from kvtierd.tiering.tier_manager import TierManager

REPO = pathlib.Path(__file__).resolve().parents[2]
LAYOUT = Layout("m", 2, 2, 16, 4)  # 1 KiB a block
NAMESPACE = Namespace(LAYOUT)
PROMPT = list(range(100, 116))  # 4 blocks


def prompt(i: int, num_blocks: int = 12) -> list[int]:
    return list(range(10_000 * (i + 1), 10_000 * (i + 1) + num_blocks * LAYOUT.block_size))


def check_metrics(promtool: str, text: bytes) -> None:
    done = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, timeout=60)
    assert done.returncode == 0, (done.stdout + done.stderr).decode()


def samples(text: bytes | str) -> dict[tuple[str, tuple], float]:
    """Every sample of an exposition, keyed by (sample name, sorted labels)."""
    if isinstance(text, bytes):
        text = text.decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(scraped: dict, name: str, **labels) -> float:
    return scraped[(name, tuple(sorted(labels.items())))]


class Traffic:
    """Runs prompts through a TierManager and counts what the index should have seen."""

    def __init__(self, manager: TierManager) -> None:
        self.manager = manager
        self.num_query_tokens = 0

    def acquire(self, request_id: str, token_ids: list[int]):
        chain = NAMESPACE.hash_blocks(token_ids)
        acquisition = self.manager.acquire(request_id, chain, 0, token_ids)
        self.num_query_tokens += len(chain) * LAYOUT.block_size
        num_ready = acquisition.ticket.wait(10)
        if num_ready < len(chain):
            parent = chain[num_ready - 1] if num_ready else NAMESPACE.root
            self.manager.commit(request_id, num_ready, chain[num_ready:],
                                token_ids[num_ready * LAYOUT.block_size:], parent)
        self.manager.drain()
        return acquisition

    def run(self, request_id: str, token_ids: list[int]):
        acquisition = self.acquire(request_id, token_ids)
        self.manager.release(request_id)
        self.manager.drain()
        return acquisition


@pytest.fixture
def pool(tmp_path):
    """A DaemonMetrics over a real TierManager (T0 16 blocks, T1 1 MiB, T2 4 MiB) after traffic
    that hits every tier, evicts from T0 and T1, and leaves one request holding 3 blocks."""
    metrics = DaemonMetrics()
    manager = TierManager(LAYOUT, 16, TierConfig(host_capacity_bytes=1 << 20),
                          ssd_config=SsdTierConfig([str(tmp_path)], 1 << 22), device="cpu",
                          root=NAMESPACE.root, observer=metrics.index_observer("m"))
    metrics.add_pool_source("m", LAYOUT.block_size, LAYOUT.bytes_per_block, manager.stats)
    traffic = Traffic(manager)
    try:
        traffic.run("a", PROMPT)
        assert traffic.run("a-again", PROMPT).num_t0_hit_blocks == 4
        for i in range(24):  # 288 blocks through T0 and into T1 (256 slots of 4 KiB): both evict
            traffic.run(f"push-{i}", prompt(i))
        assert traffic.run("a-from-ssd", PROMPT).num_t2_blocks == 4
        assert traffic.run("from-host", prompt(22)).num_t1_blocks == 12
        traffic.acquire("held", prompt(100, num_blocks=3))
        yield metrics, manager, traffic
    finally:
        metrics.close()
        manager.close()


def test_scrape_reports_what_the_tier_manager_reports(pool):
    """Every pool series equals the matching field of TierManager.stats() at that moment."""
    metrics, manager, _ = pool
    scraped = samples(metrics.render())
    stats = manager.stats()
    t0, t1, t2, ssd = stats.t0, stats.t1, stats.t2, stats.ssd
    assert stats.num_free_blocks == 16 - 3 and t1.num_evictions > 0 and t2.num_hit_blocks == 4
    m = {"model": "m"}
    expected = {("kvtierd_tier_used_bytes", "t0"): 3 * LAYOUT.bytes_per_block}
    for usage in (t0, t1, t2):
        expected[("kvtierd_tier_capacity_bytes", usage.tier)] = usage.capacity_bytes
        expected[("kvtierd_tier_used_bytes", usage.tier)] = usage.used_bytes
        expected[("kvtierd_cached_blocks", usage.tier)] = usage.num_cached_blocks
        expected[("kvtierd_prefix_hit_blocks_total", usage.tier)] = usage.num_hit_blocks
    for usage in (t1, t2):
        expected[("kvtierd_evictions_total", usage.tier)] = usage.num_evictions
        expected[("kvtierd_tier_fair_share_bytes", usage.tier)] = usage.fair_share_bytes
        expected[("kvtierd_prefix_hit_tokens_total", usage.tier)] = usage.num_hit_blocks * LAYOUT.block_size
    assert t1.fair_share_bytes == t1.capacity_bytes > 0  # the only layout: the whole budget is its share
    assert t0.used_bytes == 3 * LAYOUT.bytes_per_block and t1.num_cached_blocks > 0
    for (name, tier), want in expected.items():
        assert value(scraped, name, tier=tier, **m) == want, (name, tier)
    for direction in ("d2h", "h2d", "h2h"):
        assert value(scraped, "kvtierd_transfer_bytes_total", direction=direction, **m) == \
            stats.bytes_moved[direction]
        assert value(scraped, "kvtierd_transfer_bandwidth_bytes_per_second", direction=direction, **m) == \
            pytest.approx(stats.bandwidth_bytes_per_s[direction])
    for edge in ("t0_t1", "t1_t2"):
        assert value(scraped, "kvtierd_offloaded_blocks_total", edge=edge, **m) == stats.num_offloaded_blocks[edge]
    assert value(scraped, "kvtierd_t0_free_blocks", **m) == 13
    assert value(scraped, "kvtierd_t0_blocks", **m) == 16
    assert value(scraped, "kvtierd_failed_loads_total", **m) == stats.num_failed_load_blocks
    assert value(scraped, "kvtierd_failed_offloads_total", **m) == stats.num_failed_offload_blocks
    for tier in ("t1", "t2"):
        assert value(scraped, "kvtierd_skipped_slow_blocks_total", tier=tier, **m) == \
            stats.num_skipped_slow_blocks[tier]
    assert value(scraped, "kvtierd_recompute_seconds_per_token", **m) == 0  # no engine reported, no override
    assert value(scraped, "kvtierd_ssd_corrupted_blocks_dropped_total", **m) == \
        ssd.num_corrupted_blocks + ssd.num_dropped_on_open
    assert value(scraped, "kvtierd_ssd_io_errors_total", **m) == ssd.num_io_errors
    assert value(scraped, "kvtierd_ssd_unauthentic_blocks_total", **m) == ssd.num_unauthentic_blocks
    assert value(scraped, "kvtierd_ssd_admitting", **m) == 1


def test_index_observer_counts_queries_t0_hits_and_evictions(pool):
    """Query tokens are every full-block token acquired; t0 hit tokens match the pool's t0 hit
    blocks; each T0 eviction is one count and one sample in both age histograms."""
    metrics, manager, traffic = pool
    scraped = samples(metrics.render())
    m = {"model": "m"}
    assert value(scraped, "kvtierd_prefix_query_tokens_total", **m) == traffic.num_query_tokens
    assert value(scraped, "kvtierd_prefix_hit_tokens_total", tier="t0", **m) == \
        manager.stats().t0.num_hit_blocks * LAYOUT.block_size == 4 * LAYOUT.block_size
    num_evictions = value(scraped, "kvtierd_evictions_total", tier="t0", **m)
    assert num_evictions >= 24 * 12 - 16  # the pushes alone evict all but the pool's worth
    assert value(scraped, "kvtierd_block_lifetime_seconds_count", **m) == num_evictions
    assert value(scraped, "kvtierd_block_idle_before_evict_seconds_count", **m) == num_evictions
    assert value(scraped, "kvtierd_block_lifetime_seconds_sum", **m) >= \
        value(scraped, "kvtierd_block_idle_before_evict_seconds_sum", **m)
    assert value(scraped, "kvtierd_block_reuse_gap_seconds_count", **m) == 4  # "a-again" reused 4 released blocks
    assert value(scraped, "kvtierd_block_reuse_gap_seconds_bucket", le="+Inf", **m) == 4


def test_rpc_and_session_metrics():
    metrics = DaemonMetrics()
    metrics.observe_rpc("Acquire", "OK", 0.0003)
    metrics.observe_rpc("Acquire", "OK", 0.002)
    metrics.observe_rpc("Acquire", "RESOURCE_EXHAUSTED", 0.00004)
    for _ in range(3):
        metrics.session_opened()
    metrics.session_closed(5, "lease_expired")
    metrics.session_closed(0, "stream_closed")
    scraped = samples(metrics.render())
    ok = {"method": "Acquire", "code": "OK"}
    assert value(scraped, "kvtierd_rpc_total", **ok) == 2
    assert value(scraped, "kvtierd_rpc_total", method="Acquire", code="RESOURCE_EXHAUSTED") == 1
    assert value(scraped, "kvtierd_rpc_duration_seconds_count", **ok) == 2
    assert value(scraped, "kvtierd_rpc_duration_seconds_sum", **ok) == pytest.approx(0.0023)
    assert value(scraped, "kvtierd_rpc_duration_seconds_bucket", le="0.00025", **ok) == 0
    assert value(scraped, "kvtierd_rpc_duration_seconds_bucket", le="0.0005", **ok) == 1
    assert value(scraped, "kvtierd_rpc_duration_seconds_bucket", le="5e-05", method="Acquire",
                 code="RESOURCE_EXHAUSTED") == 1
    assert value(scraped, "kvtierd_sessions") == 1
    assert value(scraped, "kvtierd_sessions_reclaimed_total", reason="lease_expired") == 1
    assert value(scraped, "kvtierd_sessions_reclaimed_total", reason="stream_closed") == 1
    assert value(scraped, "kvtierd_reclaimed_refs_total") == 5


def test_each_daemon_metrics_has_its_own_registry():
    """Two instances register the same names without clashing, and count apart."""
    first, second = DaemonMetrics(), DaemonMetrics()
    first.session_opened()
    assert value(samples(first.render()), "kvtierd_sessions") == 1
    assert value(samples(second.render()), "kvtierd_sessions") == 0


def test_removed_or_failing_pools_are_left_out_and_the_rest_still_scraped():
    metrics = DaemonMetrics()
    observer = metrics.index_observer("gone")
    observer.on_query(8, 4)

    def broken() -> dict:
        raise RuntimeError("pool closed under the scrape")

    metrics.add_pool_source("gone", 4, 1024, lambda: {})
    metrics.add_pool_source("broken", 4, 1024, broken)
    metrics.remove_pool_source("gone")
    scraped = samples(metrics.render())
    assert not [key for key in scraped if key[0] == "kvtierd_t0_blocks"]
    assert value(scraped, "kvtierd_prefix_query_tokens_total", model="gone") == 8  # counters outlive the pool
    assert value(scraped, "kvtierd_prefix_hit_tokens_total", model="gone", tier="t0") == 4


def test_promtool_accepts_the_rendered_and_the_served_exposition(pool, promtool):
    metrics, _, _ = pool
    metrics.observe_rpc("Lookup", "OK", 0.001)
    metrics.session_opened()
    metrics.session_closed(2, "detached")
    rendered = metrics.render()
    check_metrics(promtool, rendered)
    _, port = metrics.serve_http("127.0.0.1", 0)
    assert port != 0
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        served = response.read()
    check_metrics(promtool, served)
    assert value(samples(served), "kvtierd_tier_capacity_bytes", model="m", tier="t2") == 1 << 22
    metrics.close()
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)


def test_bucket_histogram_counts_the_same_in_small_and_large_batches():
    """A value equal to a bound lands in that bound's bucket (Prometheus `le`), both paths agree."""
    from kvtierd.metrics.bucket_histogram import BucketHistogram

    values = [0.0, 0.1, 0.10001, 1.0, 5.0, 10.0, 11.0, 1e9] * 4
    small, large = BucketHistogram([0.1, 1, 10]), BucketHistogram([0.1, 1, 10])
    for value in values:
        small.observe_many([value])  # bisect path
    large.observe_many(values)  # numpy path (32 values)
    expected = [("0.1", 8), ("1.0", 16), ("10.0", 24), ("+Inf", 32)]
    assert small.cumulative() == large.cumulative() == expected
    assert small.sum == pytest.approx(large.sum) and small.count == 32


def test_tenant_usage_and_quota_gauges_from_a_live_daemon(tmp_path):
    """kvtierd_tenant_used_bytes counts what the T0 quota limits (held references) and
    kvtierd_tenant_quota_bytes reports the configured limit, per tenant and tier."""
    import os

    from kvtierd.client import KvtierClient
    from kvtierd.launch.daemon_process import DaemonProcess, small_daemon_args
    from tests.server.e2e_runner import LAYOUT, prompt

    config = tmp_path / "kvtierd.toml"
    config.write_text(f'[quotas."uid:{os.getuid()}"]\nt0_bytes = "64KiB"\nt1_bytes = "1MiB"\n')
    with DaemonProcess(small_daemon_args(str(tmp_path), extra=["--config", str(config)])) as daemon, \
            KvtierClient(daemon.address) as client:
        session = client.attach(LAYOUT)
        tokens = prompt(5, 32)
        hashes = session.namespace.hash_blocks(tokens)
        session.acquire("r", hashes, 0, tokens)  # 8 blocks of 1 KiB held
        families = {f.name: f for f in text_string_to_metric_families(
            urllib.request.urlopen(daemon.metrics_url, timeout=10).read().decode())}
        used = {(s.labels["tenant"], s.labels["tier"]): s.value for s in families["kvtierd_tenant_used_bytes"].samples}
        quota = {(s.labels["tenant"], s.labels["tier"]): s.value
                 for s in families["kvtierd_tenant_quota_bytes"].samples}
        tenant = f"uid:{os.getuid()}"
        assert used[(tenant, "t0")] == 8 * LAYOUT.bytes_per_block
        assert (quota[(tenant, "t0")], quota[(tenant, "t1")], quota[(tenant, "t2")]) == (65536, 1 << 20, 0)
        session.release("r")
