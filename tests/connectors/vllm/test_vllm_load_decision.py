"""The vLLM connector and hits slower to load than to recompute: the worker measures its prefill
forwards (forward_timing.py) and reports them on its Acquires, the scheduler's Lookup is told
which blocks the daemon declines and promises vLLM only the rest (no load fails for it), and the
declined tokens are counted in the connector's metrics. Driven in vLLM's call order (vllm_fakes.py)
against a real `kvtierd serve` whose SSD reads are slow on purpose."""

from __future__ import annotations

import pytest
import torch

from kvtierd.client import KvtierClient
from kvtierd.connectors.prefill_cost import PrefillCost
from kvtierd.connectors.vllm.forward_timing import ForwardTimer, is_sample
from kvtierd.connectors.vllm.metadata import GroupBlocks, LoadSpec, StepMetadata
from kvtierd.launch.daemon_process import wait_until, written_through
from kvtierd.tiering.load_decision import MIN_SAMPLES
from tests.connectors.vllm.vllm_fakes import BLOCK_SIZE, Engine, Request, prom_metrics, prompt
from tests.server.slow_t2_daemon import slow_t2_daemon

READ_DELAY_S = 0.4  # per read of a run of SSD slots: 5 blocks load at ~80 kB/s, the fake forward takes microseconds


def load_spec(is_async: bool) -> LoadSpec:
    return LoadSpec("r", (GroupBlocks(0, 0, (b"h",), tuple(range(BLOCK_SIZE)), (3,)),), is_async)


def test_a_sample_is_a_step_mostly_of_prefill_with_no_synchronous_load():
    assert is_sample(StepMetadata(num_scheduled_tokens=64, num_prefill_tokens=60), min_tokens=16)
    assert not is_sample(StepMetadata(num_scheduled_tokens=8, num_prefill_tokens=8), min_tokens=16)  # too short
    assert not is_sample(StepMetadata(num_scheduled_tokens=64, num_prefill_tokens=20), min_tokens=16)  # mostly decode
    assert is_sample(StepMetadata([load_spec(is_async=True)], num_scheduled_tokens=64, num_prefill_tokens=64), 16)
    assert not is_sample(StepMetadata([load_spec(is_async=False)], num_scheduled_tokens=64, num_prefill_tokens=64),
                         16)


def test_the_timer_brackets_prefill_forwards_on_the_cpu_and_skips_the_rest():
    cost = PrefillCost(min_tokens=16)
    timer = ForwardTimer(cost)
    prefill = StepMetadata(num_scheduled_tokens=64, num_prefill_tokens=64)
    timer.step_started(prefill)
    timer.step_ended()
    assert cost.num_samples == 0  # no device registered yet: not an engine's forward
    timer.device = torch.device("cpu")
    for metadata in (StepMetadata(num_scheduled_tokens=4, num_prefill_tokens=0), prefill):
        timer.step_started(metadata)
        torch.randn(256, 256) @ torch.randn(256, 256)  # the forward
        timer.step_ended()
    assert cost.num_samples == 1 and cost.s_per_token > 0
    timer.step_ended()  # a wait_for_save with no bracket open (a step that was no sample) adds nothing
    assert cost.num_samples == 1


@pytest.mark.gpu
def test_on_cuda_the_timer_reads_a_forward_from_its_events_once_they_completed():
    """The bracket is two timing events; the sample is taken at a later step, never waited for."""
    cost = PrefillCost(min_tokens=16)
    timer = ForwardTimer(cost)
    timer.device = torch.device("cuda")
    a = torch.randn(2048, 2048, device="cuda")
    timer.step_started(StepMetadata(num_scheduled_tokens=64, num_prefill_tokens=64))
    for _ in range(20):
        a = a @ a / 2048  # the forward, launched
    timer.step_ended()
    assert cost.num_samples == 0  # read once completed, at a later step
    torch.cuda.synchronize()
    timer.step_started(StepMetadata(num_scheduled_tokens=1, num_prefill_tokens=0))
    assert cost.num_samples == 1 and cost.s_per_token > 0


def test_declined_tokens_become_vllm_s_counter_by_tier():
    registry, metrics = prom_metrics(["engine"], {0: ["0"]})
    metrics.observe({"declined_tokens_t2": 64, "declined_tokens_t3": 32})
    assert registry.get_sample_value("vllm:kvtierd_declined_slow_tokens_total", {"engine": "0", "tier": "t2"}) == 64
    assert registry.get_sample_value("vllm:kvtierd_declined_slow_tokens_total", {"engine": "0", "tier": "t3"}) == 32
    assert registry.get_sample_value("vllm:kvtierd_declined_slow_tokens_total", {"engine": "0", "tier": "t1"}) == 0


@pytest.fixture
def slow_ssd_daemon(tmp_path):
    with slow_t2_daemon(str(tmp_path), READ_DELAY_S) as daemon_and_client:
        yield daemon_and_client


def only_in_t2(client: KvtierClient) -> None:
    assert wait_until(lambda: written_through(client), timeout_s=30), client.stats()
    client.evict(tiers=["t0", "t1"])


def counted(engine: Engine) -> dict:
    """What both sides counted since their last report (vLLM's connector metrics)."""
    data: dict = {}
    for side in (engine.scheduler, engine.worker):
        report = side.get_kv_connector_stats()
        for key, value in (report.data if report is not None else {}).items():
            if key != "lookup_seconds":
                data[key] = data.get(key, 0) + value
    return data


@pytest.mark.timeout(300)
def test_a_hit_on_a_disk_slower_than_the_engine_s_prefill_is_not_promised_and_is_counted(slow_ssd_daemon):
    """A stores a prompt; the disk is measured by MIN_SAMPLES loads from T2 (measured fewer times:
    loaded); then the same prefix is declined at the Lookup: vLLM is promised nothing, computes the blocks,
    no load fails, and both the connector and the daemon count the declined blocks."""
    _, client = slow_ssd_daemon
    engine = Engine(client.target, prefetch=False)  # prefetch reads T2 too: off, so only loads measure it
    try:
        a = Request("a", prompt(41, 22))  # 5 full blocks and 2 tokens
        engine.finish(a, engine.prefill(a).engine_block_ids)
        engine.drain()
        assert engine.worker.worker.prefill_cost.num_samples == 1  # a's forward: 22 prefill tokens
        for i in range(MIN_SAMPLES):
            only_in_t2(client)
            measuring = Request(f"measuring-{i}", list(a.all_token_ids))
            step = engine.prefill(measuring)
            assert step.num_external_tokens == 5 * BLOCK_SIZE and step.load_error_block_ids == set()
            engine.finish(measuring, step.engine_block_ids)
            engine.drain()
        counted(engine)  # reset the reports
        only_in_t2(client)
        declined = Request("declined", list(a.all_token_ids))
        step = engine.prefill(declined)
        assert step.num_external_tokens == 0 and step.metadata.loads == []  # vLLM computes every block
        engine.finish(declined, step.engine_block_ids)
        engine.drain()
        figures = counted(engine)
        assert figures.get("declined_tokens_t2") == 5 * BLOCK_SIZE
        assert not figures.get("failed_load_blocks") and not figures.get("loaded_tokens_t2")
        pool, = client.stats().pools
        t2 = next(t for t in pool.tiers if t.tier == "t2")
        assert t2.num_declined_blocks == 5 and t2.num_hit_blocks == 5 * MIN_SAMPLES  # the measuring loads only
        assert pool.num_failed_load_blocks == 0 and pool.recompute_source == "measured"
    finally:
        engine.close()
