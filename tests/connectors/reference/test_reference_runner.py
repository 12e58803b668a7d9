"""The reference runner against a real daemon: a prefix restored from T0, T1 or T2 generates
exactly what a full recompute generates; tenants and salts never share a block; n > 1 forks
copy on write; nothing leaks."""

from __future__ import annotations

import pytest
import torch

from kvtierd.client import KvtierClient
from kvtierd.connectors.reference.kv_backend import PrivateKv
from kvtierd.connectors.reference.runner import GenerationRequest, ReferenceRunner
from kvtierd.connectors.reference.runner_connector import KvtierdConnector
from kvtierd.launch.daemon_process import DaemonProcess, small_daemon_args
from tests.connectors.reference.connector_factories import TOY, prompt, toy_model

BLOCK_SIZE = 4
LAYOUT = TOY.layout("toy-llama", BLOCK_SIZE)  # 2 layers x 2 x 4 tokens x 2 heads x 16 dims x 4 B = 2 KiB a block
MODEL = toy_model()
# 1 s a token overrides the runner's measured prefill: no load comes near it, every lower-tier hit loads
ALWAYS_LOAD = ["--set", "policy.recompute_s_per_token=1"]
PROMPT = prompt(21, 42)  # 10 full blocks and 2 tokens


def recompute(request: GenerationRequest):
    """The oracle: the same request on a private pool with no cache."""
    return ReferenceRunner(MODEL, PrivateKv(LAYOUT, 64), record_logits=True).generate([request])[0]


def assert_same_generation(result, expected) -> None:
    assert result.output_token_ids == expected.output_token_ids
    for ours, theirs in zip(result.step_logits, expected.step_logits):
        torch.testing.assert_close(torch.stack(ours), torch.stack(theirs), atol=1e-4, rtol=0)


def daemon_args(directory, *extra: str, **sizes) -> list[str]:
    return small_daemon_args(str(directory), **sizes, extra=[*ALWAYS_LOAD, *extra])


def held_blocks(client: KvtierClient) -> int:
    pool, = client.stats().pools
    return pool.num_blocks - pool.num_free_blocks


@pytest.fixture
def runner_on(tmp_path):
    """`runner_on(daemon)`: a runner attached to that daemon, with its client."""
    clients = []

    def attach(daemon: DaemonProcess, token: str | None = None):
        client = KvtierClient(daemon.address, token=token)
        clients.append(client)
        return ReferenceRunner(MODEL, KvtierdConnector(client.attach(LAYOUT)), record_logits=True), client

    yield attach
    for client in clients:
        client.close()


def test_a_prefix_restored_from_t0_generates_what_recompute_generates(tmp_path, runner_on):
    request = GenerationRequest("r", PROMPT, max_new_tokens=12)
    expected = recompute(request)
    with DaemonProcess(daemon_args(tmp_path, t0_bytes="256KiB")) as daemon:
        runner, client = runner_on(daemon)
        cold = runner.generate([request])[0]
        warm = runner.generate([request])[0]
        assert (cold.num_hit_tokens, cold.num_computed_prompt_tokens) == (0, 42)
        assert (warm.num_t0_hit_tokens, warm.num_computed_prompt_tokens) == (40, 2)
        assert_same_generation(cold, expected)
        assert_same_generation(warm, expected)
        assert held_blocks(client) == 0


def test_a_prefix_restored_from_t1_generates_what_recompute_generates(tmp_path, runner_on):
    """T0 holds 24 blocks; three other prompts push the first one's blocks down to T1."""
    request = GenerationRequest("r", PROMPT, max_new_tokens=12)
    expected = recompute(request)
    with DaemonProcess(daemon_args(tmp_path, t0_bytes="48KiB", host_bytes="1MiB")) as daemon:
        runner, client = runner_on(daemon)
        runner.generate([request])
        for seed in (1, 2, 3):
            runner.generate([GenerationRequest(f"other-{seed}", prompt(seed, 60), max_new_tokens=4)])
        restored = runner.generate([request])[0]
        assert restored.num_t1_hit_tokens >= 32, restored
        assert restored.num_hit_tokens == 40 and restored.num_computed_prompt_tokens == 2
        assert_same_generation(restored, expected)
        assert held_blocks(client) == 0


def test_a_prefix_restored_from_t2_after_a_restart_generates_what_recompute_generates(tmp_path, runner_on):
    """Blocks written through to the SSD tier survive SIGTERM; the restarted daemon loads them."""
    request = GenerationRequest("r", PROMPT, max_new_tokens=12)
    expected = recompute(request)
    write_through = ("--set", "policy.t0_to_t1=write_through")
    with DaemonProcess(daemon_args(tmp_path, *write_through)) as daemon:
        runner, client = runner_on(daemon)
        runner.generate([request])
        client.close()
        assert daemon.stop() == 0
    with DaemonProcess(daemon_args(tmp_path, *write_through)) as daemon:
        runner, _ = runner_on(daemon)
        restored = runner.generate([request])[0]
        assert (restored.num_t2_hit_tokens, restored.num_computed_prompt_tokens) == (40, 2)
        assert_same_generation(restored, expected)


def test_two_tenants_with_the_same_prompt_never_share_a_block(tmp_path, runner_on):
    """Tenant B's identical prompt gets no hit and no block tenant A's cache holds."""
    tokens_file = tmp_path / "tokens"
    tokens_file.write_text("acme a-token\nglobex g-token\n")
    request = GenerationRequest("r", PROMPT, max_new_tokens=6)
    with DaemonProcess(small_daemon_args(str(tmp_path), t0_bytes="256KiB",
                                         extra=["--tokens-file", str(tokens_file)])) as daemon:
        runner_a, _ = runner_on(daemon, token="a-token")
        runner_b, _ = runner_on(daemon, token="g-token")
        tables = {}
        for name, runner in (("a", runner_a), ("b", runner_b)):
            backend = runner.backend
            start = backend.start
            backend.start = lambda *args, _start=start, _name=name: tables.setdefault(_name, []).append(
                _start(*args)) or tables[_name][-1]
        a = runner_a.generate([request])[0]
        b = runner_b.generate([request])[0]
        assert (a.num_hit_tokens, b.num_hit_tokens) == (0, 0)
        assert not set(tables["a"][0].block_ids) & set(tables["b"][0].block_ids)
        again = runner_a.generate([request])[0]
        assert again.num_t0_hit_tokens == 40  # A's own blocks were cached all along
        assert tables["a"][1].block_ids[:10] == tables["a"][0].block_ids[:10]
        assert a.output_token_ids == b.output_token_ids == again.output_token_ids


def test_cache_salt_and_lora_id_separate_the_key_space(tmp_path, runner_on):
    with DaemonProcess(daemon_args(tmp_path, t0_bytes="256KiB")) as daemon:
        runner, _ = runner_on(daemon)
        runner.generate([GenerationRequest("r", PROMPT, max_new_tokens=2, cache_salt="user-1")])
        hits = {}
        for name, kwargs in (("same salt", dict(cache_salt="user-1")), ("other salt", dict(cache_salt="user-2")),
                             ("no salt", {}), ("lora", dict(cache_salt="user-1", lora_id="adapter-7"))):
            hits[name] = runner.generate([GenerationRequest(name, PROMPT, max_new_tokens=2,
                                                            **kwargs)])[0].num_hit_tokens
        assert hits == {"same salt": 40, "other salt": 0, "no salt": 0, "lora": 0}


def test_n_samples_fork_and_copy_on_write_matches_independent_runs(tmp_path, runner_on):
    """n=3 sampled continuations share the prompt's blocks; each equals a solo run with its seed
    (a write leaking into a sibling's block would change the others), and all blocks return."""
    request = GenerationRequest("r", PROMPT, max_new_tokens=10, n=3, temperature=1.0, seed=40)
    with DaemonProcess(daemon_args(tmp_path, t0_bytes="256KiB")) as daemon:
        runner, client = runner_on(daemon)
        forked = runner.generate([request])[0]
        solo = [recompute(GenerationRequest("s", PROMPT, max_new_tokens=10, temperature=1.0, seed=40 + i))
                for i in range(3)]
        assert forked.output_token_ids == [s.output_token_ids[0] for s in solo]
        assert len({tuple(o) for o in forked.output_token_ids}) == 3  # the samples did diverge
        assert held_blocks(client) == 0


def test_a_batch_of_requests_with_their_own_tables_matches_recompute(tmp_path, runner_on):
    """Three requests in one generate call, one of them a cache hit, decode together."""
    requests = [GenerationRequest("a", PROMPT, max_new_tokens=7),
                GenerationRequest("b", prompt(5, 17), max_new_tokens=9),
                GenerationRequest("c", prompt(6, 30), max_new_tokens=5)]
    with DaemonProcess(daemon_args(tmp_path, t0_bytes="256KiB")) as daemon:
        runner, client = runner_on(daemon)
        runner.generate([requests[0]])
        results = runner.generate(requests)
        assert [r.num_t0_hit_tokens for r in results] == [40, 0, 0]
        for result, request in zip(results, requests):
            assert_same_generation(result, recompute(request))
        assert held_blocks(client) == 0


@pytest.mark.gpu
def test_on_cuda_a_prefix_restored_from_t1_matches_the_cpu_recompute(tmp_path):
    """The daemon's pool in GPU memory (CUDA IPC), the model on the GPU: a T1 restore gives the
    tokens of the CPU recompute (fp32, so greedy choices agree), attention through SDPA on the GPU."""
    from kvtierd.connectors.reference.llama_model import LlamaModel
    from kvtierd.connectors.reference.llama_weights import random_weights

    cuda_model = LlamaModel(TOY, random_weights(TOY, seed=1), device="cuda")
    request = GenerationRequest("r", PROMPT, max_new_tokens=12)
    expected = recompute(request)
    args = daemon_args(tmp_path, "--device", "cuda", t0_bytes="48KiB", host_bytes="1MiB")
    with DaemonProcess(args) as daemon, KvtierClient(daemon.address) as client:
        runner = ReferenceRunner(cuda_model, KvtierdConnector(client.attach(LAYOUT)), record_logits=True)
        assert runner.backend.pool.is_cuda
        runner.generate([request])
        for seed in (1, 2, 3):
            runner.generate([GenerationRequest(f"other-{seed}", prompt(seed, 60), max_new_tokens=4)])
        restored = runner.generate([request])[0]
        assert restored.num_t1_hit_tokens >= 32 and restored.num_computed_prompt_tokens == 2
        assert restored.output_token_ids == expected.output_token_ids
        for ours, theirs in zip(restored.step_logits, expected.step_logits):
            torch.testing.assert_close(torch.stack(ours).cpu(), torch.stack(theirs), atol=1e-3, rtol=0)
        assert held_blocks(client) == 0
