"""The reference runner against a daemon whose SSD reads are slow on purpose
(tests/server/slow_t2_serve.py, every read of a run of slots sleeps first): a hit there is loaded
only while the disk has not been measured, then declined as slower than the runner's own prefill,
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
from tests.connectors.reference.connector_factories import TOY, prompt, toy_model
from tests.server.slow_t2_daemon import slow_t2_daemon

READ_DELAY_S = 1.5  # per read of a run of slots: 10 blocks of 2 KiB load at ~14 kB/s; the runner prefills in ms
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
    # Its Acquire reports the runner's cost; T2's reads were never measured, so the hit is loaded
    # (a first guess never declines a tier), and the slow read measures the disk.
    measuring = generate("measuring")
    assert (measuring.num_t2_hit_tokens, measuring.num_computed_prompt_tokens) == (40, 2)
    reported_s = runner.backend.prefill_cost.s_per_token  # measured on the cold prefill (2 tokens are no sample)
    only_in_t2(client)
    declined = generate("declined")
    assert (declined.num_hit_tokens, declined.num_computed_prompt_tokens) == (0, 42)
    assert cold.output_token_ids == measuring.output_token_ids == declined.output_token_ids == \
        expected.output_token_ids
    pool, t2 = t2_tier(client)
    assert t2.num_declined_blocks == 10 and t2.num_hit_blocks == 10  # the measuring load only
    assert pool.recompute_source == "measured" and pool.num_recompute_reports == 2
    assert pool.recompute_s_per_token == pytest.approx(reported_s)  # both Acquires reported the same figure
