"""The reference runner on node B, with a prefix node A computed: loaded from the shared store,
it generates exactly what recompute generates."""

from __future__ import annotations

import pytest
import torch

from kvtierd.client import KvtierClient
from kvtierd.connectors.reference.kv_backend import PrivateKv
from kvtierd.connectors.reference.runner import GenerationRequest, ReferenceRunner
from kvtierd.connectors.reference.runner_connector import KvtierdConnector
from kvtierd.launch.daemon_process import DaemonProcess, small_daemon_args, wait_until
from tests.connectors.reference.connector_factories import TOY, prompt, toy_model

pytestmark = pytest.mark.timeout(180)
LAYOUT = TOY.layout("toy-llama", 4)  # 2 KiB blocks
MODEL = toy_model()
PROMPT = prompt(31, 42)  # 10 full blocks and 2 tokens


def node_args(directory, seeds: str) -> list[str]:
    return small_daemon_args(str(directory), t0_bytes="256KiB", extra=[
        "--set", f"remote.endpoints={seeds}", "--set", "policy.t0_to_t1=write_through",
        "--set", "policy.recompute_s_per_token=1"])  # 1 s a token: no load comes near, every hit loads


def test_node_b_loads_node_a_prefix_from_t3_and_generates_what_recompute_generates(tmp_path, redis_cluster):
    """Node B holds nothing locally: its 40 cached tokens all come from T3, token for token and
    logit for logit the generation equals a private recompute."""
    request = GenerationRequest("r", PROMPT, max_new_tokens=12)
    expected = ReferenceRunner(MODEL, PrivateKv(LAYOUT, 64), record_logits=True).generate([request])[0]
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with DaemonProcess(node_args(tmp_path / "a", redis_cluster.seeds)) as a, \
            DaemonProcess(node_args(tmp_path / "b", redis_cluster.seeds)) as b, \
            KvtierClient(a.address) as on_a, KvtierClient(b.address) as on_b:
        first = ReferenceRunner(MODEL, KvtierdConnector(on_a.attach(LAYOUT)), record_logits=True).generate([request])[0]
        assert first.num_hit_tokens == 0
        assert wait_until(lambda: on_a.stats().pools[0].t3.num_written_blocks >= 10, timeout_s=20)
        runner_b = ReferenceRunner(MODEL, KvtierdConnector(on_b.attach(LAYOUT)), record_logits=True)
        restored = runner_b.generate([request])[0]
        assert (restored.num_t3_hit_tokens, restored.num_t0_hit_tokens, restored.num_computed_prompt_tokens) == \
            (40, 0, 2)
        assert restored.output_token_ids == expected.output_token_ids
        for ours, theirs in zip(restored.step_logits, expected.step_logits):
            torch.testing.assert_close(torch.stack(ours), torch.stack(theirs), atol=1e-4, rtol=0)
        pool, = on_b.stats().pools
        assert pool.num_blocks == pool.num_free_blocks  # nothing leaked on B
