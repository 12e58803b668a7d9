"""What an operator tunes eviction with, against a real `kvtierd serve`: why blocks left each tier and
how long they stayed, the tier that served each query token, and the hit rate an unbounded cache
would have had, in the Stats RPC, kvtierctl's lines and the scrape."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from kvtierd.cli.kvtierctl_report import StatsView
from kvtierd.client import KvtierClient
from kvtierd.launch.daemon_process import DaemonProcess, wait_until
from kvtierd.v1 import kvtier_pb2 as pb
from tests.server.e2e_runner import LAYOUT
from tests.server.test_retention_daemon import chain, flood, put, retain, small_args, usage

HIGH = pb.RetentionHint.HIGH


def the_pool(client: KvtierClient) -> pb.PoolStats:
    (pool,) = [p for p in client.stats().pools if p.layout.model_id == LAYOUT.model_id]
    return pool


def left(pool: pb.PoolStats, tier: str) -> dict[str, int]:
    (stats,) = [t for t in pool.tiers if t.tier == tier]
    return {entry.reason: entry.num_blocks for entry in stats.left}


def scraped(daemon: DaemonProcess) -> dict[tuple[str, str, str], float]:
    """{(sample name, tier, reason): value} of LAYOUT's samples."""
    assert daemon.metrics_url is not None
    text = urllib.request.urlopen(daemon.metrics_url, timeout=10).read().decode()
    return {(sample.name, sample.labels.get("tier", ""), sample.labels.get("reason", "")): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples
            if sample.labels.get("model") == LAYOUT.model_id and "le" not in sample.labels}


def test_a_known_run_gives_the_unbounded_hit_rate_and_the_served_split(tmp_path):
    """20 chains of 8 blocks put through 64 T0 blocks (nothing goes down: t0_to_t1 off), then each read
    once: 320 query blocks over 160 distinct ones, so an unbounded cache hits 50 %; the real hit rate
    is lower. Served tokens per tier plus misses add up to the query tokens; every block that left T0
    was evicted, as many as T0's evictions."""
    args = small_args(tmp_path, "--set", "policy.t0_to_t1=off")
    with DaemonProcess(args) as daemon, KvtierClient(daemon.address) as client:
        chains = [chain(client, seed, 8) for seed in range(20)]
        for hashes, tokens in chains:
            put(client, hashes, tokens)
        for hashes, tokens in chains:
            client.get(LAYOUT, hashes, tokens)

        pool = the_pool(client)
        assert pool.num_query_blocks == 320
        assert abs(pool.num_distinct_blocks - 160) <= 2  # a HyperLogLog: within 1 % here
        assert abs(pool.unbounded_hit_rate - 0.5) <= 2 / 320
        assert pool.hit_rate == 64 / 320  # the last 8 chains, still in T0
        served = sum(t.num_hit_blocks for t in pool.tiers)
        assert served + pool.num_miss_blocks == 320 and served == round(pool.hit_rate * 320)
        (t0,) = [t for t in pool.tiers if t.tier == "t0"]
        assert left(pool, "t0") == {"evicted": t0.num_evictions, "demoted": 0, "expired": 0, "flushed": 0}
        assert t0.num_evictions > 0 and 0 < t0.residency_p50_s <= t0.residency_p90_s
        header = StatsView(client.stats()).pool_lines(pool)[0]
        assert f"hit rate {pool.hit_rate:.1%} (an unbounded cache: {pool.unbounded_hit_rate:.1%}) of 1,280 query " \
            "tokens (T0 20.0%, T1 0.0%, T2 0.0%, miss 80.0%)" in header

        metrics = scraped(daemon)
        by_tier = {tier: metrics[("kvtierd_lookup_tokens_total", tier, "")]
                   for tier in ("t0", "t1", "t2", "t3", "miss")}
        query_tokens = metrics[("kvtierd_prefix_query_tokens_total", "", "")]
        assert sum(by_tier.values()) == query_tokens == 320 * LAYOUT.block_size
        assert by_tier["miss"] == pool.num_miss_blocks * LAYOUT.block_size
        assert metrics[("kvtierd_unbounded_hit_rate", "", "")] == pool.unbounded_hit_rate
        assert metrics[("kvtierd_blocks_left_total", "t0", "evicted")] == t0.num_evictions
        assert metrics[("kvtierd_block_residency_seconds_count", "t0", "evicted")] == t0.num_evictions


def test_blocks_sent_down_are_demoted_and_an_operators_evict_is_flushed(tmp_path):
    """on_evict from T0 into T1, nothing from T1 to T2: a flood's blocks leave T0 demoted and T1
    evicted; `evict --tier t1` then leaves T1 flushed."""
    args = small_args(tmp_path, "--set", "policy.t0_to_t1=on_evict", "--set", "policy.t1_to_t2=off")
    with DaemonProcess(args) as daemon, KvtierClient(daemon.address) as client:
        flood(client, 100)  # 160 blocks through 64 in T0 and 64 in T1
        pool = the_pool(client)
        t0_left, t1_left = left(pool, "t0"), left(pool, "t1")
        assert t0_left["demoted"] == 160 - 64 and t0_left["evicted"] == 0
        assert wait_until(lambda: left(the_pool(client), "t1")["evicted"] == 160 - 64 - 64)
        assert t1_left["demoted"] == t1_left["flushed"] == 0
        client.evict(tiers=["t1"])
        assert left(the_pool(client), "t1")["flushed"] == 64
        assert any(line.startswith("  left t1: 32 evicted, 0 demoted, 0 expired, 64 flushed; stayed p50 ")
                   for line in StatsView(client.stats()).pool_lines(the_pool(client)))


def test_a_chain_whose_hint_lapsed_leaves_t0_expired(tmp_path):
    """A chain retained for 1 s outlives nothing after its hint lapsed: the next flood drops its 8
    blocks from T0 as expired, the others as evicted (nothing goes down)."""
    args = small_args(tmp_path, "--set", "policy.t0_to_t1=off")
    with DaemonProcess(args) as daemon, KvtierClient(daemon.address) as client:
        kept, kept_tokens = chain(client, 1, 8)
        put(client, kept, kept_tokens)
        assert retain(client, kept, pb.RetentionHint(retention_session="a", priority=HIGH, ttl_s=1)) \
            .num_retained_blocks == 8
        assert wait_until(lambda: usage(client).num_t0_retained_blocks == 0, timeout_s=15)
        flood(client, 100)
        assert left(the_pool(client), "t0") == {"evicted": 160 - 64, "demoted": 0, "expired": 8, "flushed": 0}
