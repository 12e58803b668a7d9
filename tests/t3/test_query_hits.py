"""The hit rate of queries answered from the shared store: an engine's Lookup (with a prefetch, as
the vLLM connector asks) counts its T3 hits once, though the prefetch reads them into T1 and the
load takes them from there; the store's own read count (kvtierd_t3_hit_blocks) counts the read."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from kvtierd.cli.kvtierctl_report import StatsView
from kvtierd.client import KvtierClient
from kvtierd.launch.daemon_process import wait_until
from tests.server.e2e_runner import LAYOUT, prompt
from tests.t3.test_two_nodes import put_chain, two_nodes


def the_pool(client: KvtierClient):
    (pool,) = [p for p in client.stats().pools if p.layout.model_id == LAYOUT.model_id]
    return pool


def prefix_tokens(daemon) -> dict[tuple[str, str], float]:
    """{(family, tier): value} of LAYOUT's kvtierd_prefix_* token counters in a scrape."""
    text = urllib.request.urlopen(daemon.metrics_url, timeout=10).read().decode()
    return {(family.name, sample.labels.get("tier", "")): sample.value
            for family in text_string_to_metric_families(text) if family.name.startswith("kvtierd_prefix_")
            for sample in family.samples if sample.labels.get("model") == LAYOUT.model_id
            and sample.name.endswith("_tokens_total")}


def test_a_prefetched_t3_hit_counts_once_where_the_lookup_promised_it(tmp_path, redis_cluster):
    """16 blocks in the store, 4 more asked that nobody holds: the Lookup's query is 20 blocks with 16
    T3 hits; its prefetch lands them in T1 and the load takes them from T1, counting nothing again:
    a hit rate of 80 %, all from T3, in Stats, kvtierctl and the metrics."""
    with two_nodes(tmp_path, redis_cluster.seeds) as (a, b), \
            KvtierClient(a.address, token="a-token") as on_a, KvtierClient(b.address, token="a-token") as on_b:
        stored_tokens, stored = put_chain(on_a, 31, 64)
        session = on_b.attach(LAYOUT)
        asked_tokens = prompt(31, 80)
        asked = session.namespace.hash_blocks(asked_tokens)
        lookup = session.lookup(asked, token_ids=asked_tokens, prefetch=True, num_query_blocks=len(asked))
        assert (lookup.total.num_blocks, lookup.total.t3) == (16, 16)
        assert wait_until(lambda: [t.num_cached_blocks for t in the_pool(on_b).tiers if t.tier == "t1"] == [16],
                          timeout_s=20)  # the prefetch's read landed
        load = session.acquire("load", stored, token_ids=stored_tokens, query_counted=True, load_every_hit=True)
        assert load.num_t1_blocks == 16 and session.wait("load") == 16
        session.release("load")

        pool = the_pool(on_b)
        assert pool.num_query_blocks == 20
        assert {t.tier: t.num_hit_blocks for t in pool.tiers} == {"t0": 0, "t1": 0, "t2": 0}
        assert (pool.t3.num_query_hit_blocks, pool.t3.num_hit_blocks) == (16, 16)  # the store read them once
        header = StatsView(on_b.stats()).pool_lines(pool)[0]
        assert "hit rate 80.0% (an unbounded cache: " in header
        assert header.endswith("of 80 query tokens (T0 0.0%, T1 0.0%, T2 0.0%, T3 80.0%, miss 20.0%)")
        tokens = prefix_tokens(b)
        assert tokens[("kvtierd_prefix_query_tokens", "")] == 80
        assert {tier: tokens[("kvtierd_prefix_hit_tokens", tier)] for tier in ("t0", "t1", "t2", "t3")} == \
            {"t0": 0, "t1": 0, "t2": 0, "t3": 64}
