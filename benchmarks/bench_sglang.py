"""SGLang with kvtierd as its HiCache storage tier: the time to first token of a prefix restored from
kvtierd beside recompute and beside SGLang's own host-pool (L2) hit, and multi-turn chat through
SGLang with and without kvtierd, in one run.

Real SGLang 0.5.23 on the CPU (.venv-sglang, scripts/install-sglang-cpu: the scaffolding docs/sglang.md
describes), a random Llama with real random weights (transformers' own init), served in fp32, greedy decoding,
each engine a process of its own (tests/connectors/sglang/sglang_engine_main.py) and one daemon.

Part 1, TTFT of one prompt of --prompt-tokens tokens, each the time of a request of one output token:
  recompute    engine 1, first request: nothing cached anywhere;
  SGLang L2    engine 1, the prompt again after other prompts pushed it out of the device pool (L1):
               SGLang's host pool (L2) still holds it and copies it back;
  kvtierd      engine 2, a new process (empty L1 and L2): the prefix comes from kvtierd (L3), which
               engine 1 wrote through to.
  Ratios: recompute / kvtierd (how much the restore saves) and kvtierd / L2 (what the daemon costs
  over SGLang's own host copy). Each TTFT's cached-token sources are printed as SGLang reports them.
Part 2, multi-turn (the workload of bench_vllm_multiturn, one request at a time): --users users, each
  a shared system prompt, a paragraph of their own and --rounds questions, the answer appended to
  the history each round; users take their rounds in turn. SGLang's device and host pools together
  hold about two thirds of the users' histories, so a user's history is gone from SGLang by their next
  round.
  Arms: SGLang alone (HiCache, no storage) and SGLang with kvtierd; the later rounds' (round >= 1)
  median TTFT, their prompt tokens from storage, every answer compared with alone's.
Goals: kvtierd TTFT <= 1.5x SGLang's own L2 hit (what the daemon adds over SGLang's host copy) and below
recompute; the later rounds' median TTFT with kvtierd <= 0.7x alone's. On a CPU SGLang's attention over
a cached prefix (the torch_native backend) costs about half a recompute (the L2 row), so a restore
saves less here than on a GPU; the cached-token columns say how much was not computed.

Run: python benchmarks/bench_sglang.py [--quick] [--python .venv-sglang/bin/python]
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import _report  # noqa: E402
from kvtierd.launch.daemon_process import DaemonProcess, small_daemon_args  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
ENGINE_MAIN = REPO / "tests" / "connectors" / "sglang" / "sglang_engine_main.py"
PAGE_SIZE = 16
VOCAB = 512  # smoke.py's word-level tokenizer: ids 3..511 are words
# A Llama large enough that prefill costs what it costs (~40 M parameters, 8 layers; KV 32 KiB a token in fp32).
MODEL_FIELDS = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                    num_key_value_heads=4, head_dim=64)
# float32: bf16 matrix products are several times slower than fp32 on a CPU without bf16 units.
ENGINE_KWARGS = {"dtype": "float32"}
ANSWER_TOKENS = 32
WRITE_MODEL = """
import json, pathlib, sys
sys.path.insert(0, sys.argv[2])
from smoke import write_tiny_llama
write_tiny_llama(pathlib.Path(sys.argv[1]), **json.loads(sys.argv[3]))
"""


def tokens(seed: int, count: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(count)]


def sglang_python(given: str | None) -> str:
    if given:
        return given
    done = subprocess.run([str(REPO / "scripts" / "install-sglang-cpu")], capture_output=True, text=True,
                          check=True)
    return done.stdout.strip().splitlines()[-1]


def run_engine(python: str, model: Path, work: Path, name: str, flags: list[str], *,
               engine_kwargs: dict, prompts: list[list[int]] | None = None, turns: dict | None = None) -> dict:
    """One engine process to its end; its result (sglang_engine_main.py's OUT_JSON)."""
    command = [python, str(ENGINE_MAIN), str(model), str(work / f"{name}.json"), "--ttft",
               "--engine-kwargs", json.dumps(engine_kwargs), *flags]
    for option, value in (("--prompts", prompts), ("--turns", turns)):
        if value is not None:
            path = work / f"{name}{option.replace('--', '.')}.json"
            path.write_text(json.dumps(value))
            command += [option, str(path)]
    env = {"PATH": "/usr/bin:/bin", "HOME": str(work)}
    with open(work / f"{name}.log", "w") as log:
        done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=1800)
    if done.returncode != 0:
        sys.exit(f"bench_sglang: engine {name} failed ({done.returncode}); its log: {work / f'{name}.log'}")
    return json.loads((work / f"{name}.json").read_text())


def sources(details: dict) -> str:
    return " / ".join(f"{k} {v}" for k, v in details.items() if k in ("device", "host", "storage") and v) or "none"


def ttft_part(python: str, model: Path, work: Path, daemon: DaemonProcess, prompt_tokens: int) -> list[tuple]:
    prompt = tokens(1, prompt_tokens)
    # An engine's first forward of a shape pays a one-time set-up (seconds here): a prompt of the same
    # length first, so that the recompute row times the prefill alone.
    warm_up = tokens(99, prompt_tokens)
    fillers = [tokens(100 + i, prompt_tokens) for i in range(2)]  # together more than the device pool
    device_tokens = 2 * prompt_tokens + 256  # holds two prompts: the fillers push the first one out
    kwargs = {**ENGINE_KWARGS, "max_total_tokens": device_tokens, "hicache_ratio": 3.0}
    flags = ["--address", daemon.address, "--max-tokens", "1"]
    first = run_engine(python, model, work, "ttft-1", [*flags, "--wait-stored", str(3 * prompt_tokens // PAGE_SIZE)],
                       engine_kwargs=kwargs, prompts=[warm_up, prompt, *fillers, prompt])
    second = run_engine(python, model, work, "ttft-2", flags, engine_kwargs=kwargs, prompts=[warm_up, prompt])
    rows = [("recompute", first["ttft_s"][1], first["cached_tokens_details"][1]),
            ("SGLang L2 (host pool)", first["ttft_s"][-1], first["cached_tokens_details"][-1]),
            ("kvtierd (L3, new engine)", second["ttft_s"][1], second["cached_tokens_details"][1])]
    assert first["output_token_ids"][1] == first["output_token_ids"][-1] == second["output_token_ids"][1]
    return rows


def multiturn_part(python: str, model: Path, work: Path, daemon: DaemonProcess, users: int, rounds: int) -> dict:
    system = tokens(2, 512)
    turns = {"users": [system + tokens(200 + u, 256) for u in range(users)],
             "questions": [tokens(300 + r, 64) for r in range(rounds)]}
    history_tokens = 512 + users * (256 + rounds * (64 + ANSWER_TOKENS))
    longest = 512 + 256 + rounds * (64 + ANSWER_TOKENS)  # the last round's prompt and answer
    # The host pool twice the device pool (SGLang's default ratio; a storage load is staged in the host
    # pool, which needs room beyond its copy of the device pool): L1 + L2 hold ~3/5 of the history.
    device_tokens = (max(longest + 4 * PAGE_SIZE, history_tokens // 5) + PAGE_SIZE - 1) // PAGE_SIZE * PAGE_SIZE
    kwargs = {**ENGINE_KWARGS, "max_total_tokens": device_tokens, "hicache_ratio": 2.0}
    flags = ["--max-tokens", str(ANSWER_TOKENS)]
    alone = run_engine(python, model, work, "turns-alone", flags, engine_kwargs=kwargs, turns=turns)
    kvtierd = run_engine(python, model, work, "turns-kvtierd", [*flags, "--address", daemon.address],
                         engine_kwargs=kwargs, turns=turns)
    return {"alone": alone["turns"], "kvtierd": kvtierd["turns"], "device_tokens": device_tokens,
            "history_tokens": history_tokens}


def later(turns: list[dict]) -> list[dict]:
    return [t for t in turns if t["round"] >= 1]


def main() -> int:
    parser = _report.argument_parser(__doc__.splitlines()[0])
    parser.add_argument("--python", help="the SGLang venv's python (default: scripts/install-sglang-cpu's)")
    parser.add_argument("--prompt-tokens", type=int, default=None)
    parser.add_argument("--users", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=None)
    args = parser.parse_args()
    prompt_tokens = args.prompt_tokens or (512 if args.quick else 2048)
    users, rounds = args.users or 8, args.rounds or (3 if args.quick else 4)
    python = sglang_python(args.python)
    _report.print_header("bench_sglang: SGLang with kvtierd as its storage tier (L3)", args.quick,
                         "timing: one request of one output token per TTFT, time.perf_counter around "
                         "sglang.Engine.generate; each engine its own process")
    with tempfile.TemporaryDirectory(prefix="bench-sglang-") as tmp:
        work = Path(tmp)
        model = work / "model"
        subprocess.run([python, "-c", WRITE_MODEL, str(model), str(REPO / "scripts" / "sglang_cpu"),
                        json.dumps(MODEL_FIELDS)], check=True, capture_output=True, timeout=600)
        daemon_args = small_daemon_args(str(work / "daemon"), t0_bytes="512MiB", host_bytes="512MiB",
                                        ssd_bytes="1GiB")
        os.makedirs(work / "daemon")
        with DaemonProcess(daemon_args) as daemon:
            rows = ttft_part(python, model, work, daemon, prompt_tokens)
        recompute_s, l2_s, kvtierd_s = (row[1] for row in rows)
        print(f"\nPart 1: TTFT of a {prompt_tokens}-token prompt ({MODEL_FIELDS['num_hidden_layers']}-layer Llama, "
              f"hidden {MODEL_FIELDS['hidden_size']}, fp32, page {PAGE_SIZE})")
        _report.print_table(["source", "TTFT ms", "cached tokens by source"],
                            [(name, f"{s * 1e3:.1f}", sources(d)) for name, s, d in rows])
        print(f"recompute / kvtierd: {recompute_s / kvtierd_s:.2f}x; kvtierd / SGLang L2: {kvtierd_s / l2_s:.2f}x "
              f"(SGLang's own L2 hit: {l2_s / recompute_s:.2f}x of recompute)")

        with DaemonProcess(small_daemon_args(str(work / "daemon2"), t0_bytes="512MiB", host_bytes="512MiB",
                                             ssd_bytes="1GiB")) as daemon:
            result = multiturn_part(python, model, work, daemon, users, rounds)
        print(f"\nPart 2: {users} users x {rounds} rounds, one request at a time; ~{result['history_tokens']} "
              f"tokens of history, SGLang's device pool {result['device_tokens']} tokens and its host pool twice that")
        print("(an engine's first request pays its one-time set-up in both arms alike: round 0 is not counted)")
        medians = {}
        table = []
        for arm in ("alone", "kvtierd"):
            turns = later(result[arm])
            medians[arm] = statistics.median(t["ttft_s"] for t in turns)
            storage = sum(t["cached_tokens_details"].get("storage", 0) for t in turns)
            cached = sum(t["cached_tokens"] for t in turns)
            prompt = sum(t["prompt_tokens"] for t in turns)
            same = sum(a["output_token_ids"] == b["output_token_ids"] for a, b in zip(result["alone"], result[arm]))
            table.append((arm, len(result[arm]), f"{medians[arm] * 1e3:.1f}", f"{cached / prompt:.0%}", storage,
                          f"{same}/{len(result[arm])}"))
        _report.print_table(["arm", "turns", "later rounds median TTFT ms", "later rounds cached", "from storage",
                             "answers as alone"], table)
        print(f"later rounds' median TTFT, kvtierd / alone: {medians['kvtierd'] / medians['alone']:.2f}x")
    _report.print_goals([("kvtierd TTFT <= 1.5x SGLang's own L2 hit", kvtierd_s <= 1.5 * l2_s),
                         ("kvtierd TTFT < recompute", kvtierd_s < recompute_s),
                         ("later rounds' median TTFT with kvtierd <= 0.7x alone's",
                          medians["kvtierd"] <= 0.7 * medians["alone"])])
    return 0


if __name__ == "__main__":
    sys.exit(main())
