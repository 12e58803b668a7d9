"""The reference runner against a daemon whose SSD reads are slow on purpose
(tests/server/slow_t2_serve.py, every read of a run of slots sleeps first): a hit there is loaded
while the disk has been measured fewer than MIN_SAMPLES times, then declined as slower than the runner's own prefill,
which the runner measures and reports on its Acquires. The declined request computes every
token, generates exactly what recompute generates, and reads nothing from the disk: its time to
first token is recompute's plus the Acquire. The daemon counts the declined blocks."""

from __future__ import annotations

import pytest

from kvtierd.client import KvtierClient
from kvtierd.connectors.reference.kv_backend import PrivateKv
from kvtierd.connectors.reference.runner import GenerationRequest, ReferenceRunner
from kvtierd.connectors.reference.runner_connector import KvtierdConnector
from kvtierd.launch.daemon_process import wait_until, written_through
from kvtierd.tier import Tier
from kvtierd.tiering.load_decision import MIN_SAMPLES
from tests.connectors.reference.connector_factories import TOY, prompt, toy_model
from tests.server.slow_t2_daemon import slow_t2_daemon

READ_DELAY_S = 0.5  # per read of a run of slots: 10 blocks of 2 KiB load at ~40 kB/s; the runner prefills in ms
LAYOUT = TOY.layout("toy-llama", 4)  # 2 KiB a block
MODEL = toy_model()
PROMPT = prompt(31, 42)  # 10 full blocks and 2 tokens


def t2_tier(client: KvtierClient):
    pool, = client.stats().pools
    return pool, next(t for t in pool.tiers if t.tier == Tier.T2)


def only_in_t2(client: KvtierClient) -> None:
    """The prompt's blocks leave T0 and T1 (written through to T2 first)."""
    assert wait_until(lambda: written_through(client), timeout_s=30), client.stats()
    client.evict(tiers=["t0", "t1"])


@pytest.fixture
def slow_ssd_daemon(tmp_path):
    with slow_t2_daemon(str(tmp_path), READ_DELAY_S) as daemon_and_client:
        yield daemon_and_client


@pytest.mark.timeout(300)
def test_a_hit_on_a_disk_slower_than_recompute_is_declined_and_the_tokens_are_recompute_s(slow_ssd_daemon):
    _, client = slow_ssd_daemon
    runner = ReferenceRunner(MODEL, KvtierdConnector(client.attach(LAYOUT)))
    expected = ReferenceRunner(MODEL, PrivateKv(LAYOUT, 64)).generate([GenerationRequest("r", PROMPT, 8)])[0]

    def generate(request_id: str):
        return runner.generate([GenerationRequest(request_id, PROMPT, max_new_tokens=8)])[0]

    cold = generate("cold")  # computes the prompt (measuring its prefill), stores it
    assert runner.backend.prefill_cost.num_samples == 1
    only_in_t2(client)
    # Its Acquires report the runner's cost; until T2's reads are measured MIN_SAMPLES times the hit
    # is loaded (neither a first guess nor one sample declines a tier), and each slow read measures the disk.
    for i in range(MIN_SAMPLES):
        measuring = generate(f"measuring-{i}")
        assert (measuring.num_t2_hit_tokens, measuring.num_computed_prompt_tokens) == (40, 2)
        assert measuring.output_token_ids == cold.output_token_ids
        only_in_t2(client)
    reported_s = runner.backend.prefill_cost.s_per_token  # measured on the cold prefill (2 tokens are no sample)
    declined = generate("declined")
    assert (declined.num_hit_tokens, declined.num_computed_prompt_tokens) == (0, 42)
    assert cold.output_token_ids == declined.output_token_ids == expected.output_token_ids
    pool, t2 = t2_tier(client)
    assert t2.num_declined_blocks == 10 and t2.num_hit_blocks == 10 * MIN_SAMPLES  # the measuring loads only
    assert pool.recompute_source == "measured" and pool.num_recompute_reports == MIN_SAMPLES + 1
    assert pool.recompute_s_per_token == pytest.approx(reported_s)  # both Acquires reported the same figure
