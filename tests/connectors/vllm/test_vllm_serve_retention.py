"""An agent's session kept warm through `vllm serve`: a completion whose `kv_transfer_params` carry a
retention hint, then a flood of other prompts through a daemon whose T0 and T1 hold a fraction of
it (T1 drops what it evicts: no T2 copy but a retained block's), then the same history again is a
kvtierd hit, while a history sent without the hint, stored after it, is a miss.

vLLM's own prefix cache is off, so every hit is kvtierd's (vllm:external_prefix_cache_hits_total
and the connector's vllm:kvtierd_loaded_tokens_total). SmolLM2-135M's blocks of 32 tokens are
720 KiB: T0 of 16 MiB holds 22 of them, T1 of 32 MiB 45; the flood stores 80. (A tenant's retained blocks
may take half a tier, retention.max_tenant_share: T0's 11 hold the hinted 10.)
"""

from __future__ import annotations

import json
import urllib.request

import pytest

from kvtierd.launch.daemon_process import DaemonProcess, small_daemon_args, wait_until
from tests.conftest import REPO
from tests.connectors.vllm.engine_process import engine_env
from tests.connectors.vllm.openai_server import SERVED_NAME, OpenAIServer
from tests.connectors.vllm.retention_support import daemon_answers_retain
from tests.connectors.vllm.test_vllm_serve import smollm2_hf  # noqa: F401  (a fixture)

pytestmark = [pytest.mark.vllm, pytest.mark.weights, pytest.mark.timeout(1800)]

BLOCK_SIZE = 32
NUM_PROMPT_BLOCKS = 10
PROMPT_TOKENS = NUM_PROMPT_BLOCKS * BLOCK_SIZE + 10  # a hit is its 10 full blocks (short of the last token)
NUM_FLOOD_PROMPTS = 8
RETENTION = {"kvtierd_retention": {"session": "agent-7", "priority": "high", "ttl_s": 600}}


def token_prompt(seed: int) -> list[int]:
    """PROMPT_TOKENS token ids of `seed` alone (SmolLM2's vocabulary is 49,152)."""
    return [(seed * 7919 + i * 31) % 48_000 + 100 for i in range(PROMPT_TOKENS)]


def complete(server: OpenAIServer, token_ids: list[int], kv_transfer_params: dict | None = None) -> dict:
    """One greedy token of a completion whose prompt is `token_ids`, as an OpenAI client sends it."""
    body = {"model": SERVED_NAME, "prompt": token_ids, "max_tokens": 1, "temperature": 0}
    if kv_transfer_params is not None:
        body["kv_transfer_params"] = kv_transfer_params
    request = urllib.request.Request(server.url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as reply:
        return json.load(reply)


def external_hit_tokens(server: OpenAIServer, token_ids: list[int]) -> float:
    """The tokens vLLM took from kvtierd for one completion of `token_ids`."""
    before = server.metric_sum("vllm:external_prefix_cache_hits_total")
    complete(server, token_ids)
    return server.metric_sum("vllm:external_prefix_cache_hits_total") - before


def test_a_hinted_history_survives_a_flood_that_evicts_an_unhinted_one(vllm_python, smollm2_hf,  # noqa: F811
                                                                       short_dir, tmp_path):
    daemon_args = small_daemon_args(short_dir, t0_bytes="16MiB", host_bytes="32MiB", ssd_bytes="64MiB",
                                    extra=["--set", "policy.t1_to_t2=off"])
    with DaemonProcess(daemon_args) as daemon:
        if not daemon_answers_retain(daemon.address):
            pytest.skip("this kvtierd predates retention hints (Retain is UNIMPLEMENTED)")
        with OpenAIServer(vllm_python, smollm2_hf, tmp_path / "serve.log", address=daemon.address,
                          extra_args=("--no-enable-prefix-caching",), env=engine_env(PYTHONPATH=str(REPO))) as server:
            server.wait_ready()

            def stored_blocks() -> float:
                return server.metric_sum("vllm:kvtierd_stored_blocks_total")

            hinted, unhinted = token_prompt(1), token_prompt(2)
            complete(server, hinted, RETENTION)
            complete(server, unhinted)
            assert wait_until(lambda: stored_blocks() >= 2 * NUM_PROMPT_BLOCKS, timeout_s=60), server.metrics()
            assert server.metric_sum("vllm:kvtierd_retained_blocks_total") == NUM_PROMPT_BLOCKS  # the Commit took it
            assert server.metric_sum("vllm:kvtierd_refused_retention_hints_total") == 0

            for seed in range(100, 100 + NUM_FLOOD_PROMPTS):
                complete(server, token_prompt(seed))
            assert wait_until(lambda: stored_blocks() >= (2 + NUM_FLOOD_PROMPTS) * NUM_PROMPT_BLOCKS, timeout_s=120), \
                server.metrics()

            loaded_before = server.metric_sum("vllm:kvtierd_loaded_tokens_total")
            assert external_hit_tokens(server, hinted) == NUM_PROMPT_BLOCKS * BLOCK_SIZE, server.log_tail()
            assert wait_until(lambda: server.metric_sum("vllm:kvtierd_loaded_tokens_total") - loaded_before
                              == NUM_PROMPT_BLOCKS * BLOCK_SIZE, timeout_s=30), server.metrics()
            assert external_hit_tokens(server, unhinted) == 0  # stored after the hinted one, evicted by the flood
