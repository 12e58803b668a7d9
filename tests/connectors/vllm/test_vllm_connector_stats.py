"""The connector's metrics as vLLM collects them: per-step reports from each side, aggregated,
rebuilt from their dict in the API server and added to Prometheus counters per engine."""

from __future__ import annotations

from kvtierd.connectors.vllm.connector import KvtierdConnector
from kvtierd.connectors.vllm.connector_stats import LOOKUP_SECONDS, KvtierdConnectorStats, KvtierdPromMetrics
from kvtierd.launch.daemon_process import wait_until
from tests.connectors.vllm.vllm_fakes import BLOCK_SIZE, Engine, Request, prom_metrics, prompt


def test_each_side_reports_what_it_did_since_its_last_report(daemon):
    engine = Engine(daemon.address)
    try:
        block_nbytes = engine.worker.engine_groups.groups[0].block_nbytes
        a = Request("a", prompt(1, 5 * BLOCK_SIZE + 3))
        a_ids = engine.prefill(a).engine_block_ids
        engine.finish(a, a_ids)
        engine.drain()
        stored = engine.worker.get_kv_connector_stats()
        assert stored.data["stored_blocks"] == 5 and stored.data["stored_bytes"] == 5 * block_nbytes
        assert stored.data["store_rpcs"] == 2  # one Acquire, one Commit that releases, for 5 blocks
        assert stored.data["store_request_bytes"] == 2 * 5 * (32 + 4 * BLOCK_SIZE)  # Acquire's and Commit's
        assert not any(stored.data.get(k) for k in ("loaded_tokens_t0", "failed_load_blocks"))
        assert engine.worker.get_kv_connector_stats() is None  # nothing since

        b = Request("b", a.prompt_token_ids[:4 * BLOCK_SIZE] + prompt(2, BLOCK_SIZE + 5))
        assert engine.prefill(b).num_external_tokens == 4 * BLOCK_SIZE
        loaded = engine.worker.get_kv_connector_stats()
        assert loaded.data["loaded_tokens_t0"] == 4 * BLOCK_SIZE
        assert loaded.data["loaded_bytes"] == 4 * block_nbytes
        lookups = engine.scheduler.get_kv_connector_stats()
        assert len(lookups.data[LOOKUP_SECONDS]) == 2 and all(0 < s < 5 for s in lookups.data[LOOKUP_SECONDS])
        assert wait_until(lambda: engine.worker.get_kv_connector_stats() is not None)  # b's own store
    finally:
        engine.close()


def test_reports_aggregate_over_ranks_and_survive_the_trip_as_a_dict():
    worker0 = KvtierdConnectorStats(data={"loaded_tokens_t0": 64, "loaded_bytes": 1000})
    worker1 = KvtierdConnectorStats(data={"loaded_bytes": 1000, "dropped_stores": 1})
    scheduler = KvtierdConnectorStats(data={LOOKUP_SECONDS: [0.002, 0.004]})
    total = worker0.aggregate(worker1).aggregate(scheduler)
    rebuilt = KvtierdConnector.build_kv_connector_stats(total.to_dict())
    assert rebuilt.data == {"loaded_tokens_t0": 64, "loaded_bytes": 2000, "dropped_stores": 1,
                            LOOKUP_SECONDS: [0.002, 0.004]}
    assert rebuilt.reduce() == {"loaded_tokens_t0": 64, "loaded_bytes": 2000, "dropped_stores": 1, "lookups": 2,
                                "lookup_mean_ms": 3.0}
    assert not rebuilt.is_empty() and KvtierdConnectorStats(data={"stored_blocks": 0}).is_empty()


def test_prometheus_counters_add_each_report_under_the_engines_labels():
    registry, metrics = prom_metrics(["model_name", "engine"], {0: ["m", "0"], 1: ["m", "1"]})
    assert isinstance(metrics, KvtierdPromMetrics)
    for _ in range(2):
        metrics.observe({"loaded_tokens_t1": 96, "stored_bytes": 10, "store_rpcs": 3, LOOKUP_SECONDS: [0.003]}, 1)

    def sample(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, {"model_name": "m", **labels})

    assert sample("vllm:kvtierd_loaded_tokens_total", engine="1", tier="t1") == 192
    assert sample("vllm:kvtierd_loaded_tokens_total", engine="0", tier="t1") == 0
    assert sample("vllm:kvtierd_bytes_total", engine="1", direction="store") == 20
    assert sample("vllm:kvtierd_store_rpcs_total", engine="1") == 6
    assert sample("vllm:kvtierd_lookup_seconds_count", engine="1") == 2
    assert sample("vllm:kvtierd_lookup_seconds_bucket", engine="1", le="0.005") == 2
