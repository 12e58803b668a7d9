"""TTFT when the SSD is slower than recompute: a prefix held only in T2, whose reads are slowed on
purpose (tests/server/slow_t2_serve.py: every read of a run of slots sleeps first), restored by
the reference runner on the CPU.

Ours: the daemon's default, which weighs the hit against the runner's measured prefill cost and
declines it: the runner recomputes, and its TTFT is recompute's plus the Acquire. Baseline, in
the same run: the same request on a private pool (a plain recompute, no daemon). Context row: the
same hit forced in (policy.recompute_s_per_token = 1 s/token: every hit loads), what a daemon
that always loads would cost. Each round evicts T0 and T1 first, so the prefix is only on the
SSD; the first T2 read of each daemon (its disk never measured) is a warm-up round. The disk is
made slower than recompute by a margin: each read of a run of slots sleeps 3x the prompt's
recompute TTFT measured first.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import _report  # noqa: E402
from kvtierd.client import KvtierClient  # noqa: E402
from kvtierd.connectors.reference.kv_backend import PrivateKv, num_blocks_for  # noqa: E402
from kvtierd.connectors.reference.llama_config import LlamaConfig  # noqa: E402
from kvtierd.connectors.reference.llama_model import LlamaModel  # noqa: E402
from kvtierd.connectors.reference.llama_weights import random_weights  # noqa: E402
from kvtierd.connectors.reference.runner import GenerationRequest, ReferenceRunner  # noqa: E402
from kvtierd.connectors.reference.runner_connector import KvtierdConnector  # noqa: E402
from kvtierd.launch.daemon_process import (  # noqa: E402
    WRITE_THROUGH,
    DaemonProcess,
    small_daemon_args,
    wait_until,
    written_through,
)

FULL = LlamaConfig(vocab_size=8192, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                   num_attention_heads=8, num_key_value_heads=4)
QUICK = LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=704, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2)
BLOCK_SIZE = 16
SLOWDOWN = 3.0  # each read of a run of SSD slots sleeps this many times the prompt's recompute first
ALWAYS_LOAD = ["--set", "policy.recompute_s_per_token=1"]


def ttfts(model: LlamaModel, layout, prompt: list[int], rounds: int, directory: str, read_delay_s: float,
          extra: Sequence[str]) -> tuple[list[float], list[float], int]:
    """(kvtierd's TTFT per round, the private recompute's per round, T2 tokens loaded in the
    timed rounds): the prefix stored once, then per round evicted to T2 and asked for again."""
    env = {"SLOW_T2_READ_DELAY_S": str(read_delay_s), "PYTHONPATH": str(ROOT)}
    args = small_daemon_args(directory, t0_bytes="64MiB", host_bytes="64MiB", ssd_bytes="256MiB",
                             extra=[*WRITE_THROUGH, *extra])
    private = private_runner(model, layout, prompt)
    ours, baseline, num_t2_tokens = [], [], 0
    with DaemonProcess(args, env=env, module="tests.server.slow_t2_serve") as daemon, \
            KvtierClient(daemon.address, timeout_s=120.0) as client:  # the forced-in loads wait on the slow disk
        runner = ReferenceRunner(model, KvtierdConnector(client.attach(layout)))
        runner.generate([GenerationRequest("store", prompt, max_new_tokens=1)])
        for i in range(rounds + 1):  # round 0: the daemon's first T2 read measures the disk
            assert wait_until(lambda: written_through(client), timeout_s=60), client.stats()
            client.evict(tiers=["t0", "t1"])
            ours_first = i % 2 == 0  # the order alternates: neither side always runs after the other
            recompute = None if ours_first else private.generate([GenerationRequest(f"p{i}", prompt, 1)])[0]
            result = runner.generate([GenerationRequest(f"r{i}", prompt, max_new_tokens=1)])[0]
            recompute = recompute or private.generate([GenerationRequest(f"p{i}", prompt, 1)])[0]
            assert result.output_token_ids == recompute.output_token_ids
            if i:
                ours.append(result.ttft_s)
                baseline.append(recompute.ttft_s)
                num_t2_tokens += result.num_t2_hit_tokens
    return ours, baseline, num_t2_tokens


def private_runner(model: LlamaModel, layout, prompt: list[int]) -> ReferenceRunner:
    return ReferenceRunner(model, PrivateKv(layout, num_blocks_for(len(prompt) + 2, BLOCK_SIZE)))


def recompute_s(model: LlamaModel, layout, prompt: list[int]) -> float:
    """The prompt's TTFT on a private pool, the best of three (the first warms up)."""
    runner = private_runner(model, layout, prompt)
    return min(runner.generate([GenerationRequest(f"w{i}", prompt, max_new_tokens=1)])[0].ttft_s for i in range(3))


def main(argv: Sequence[str] | None = None) -> int:
    args = _report.parse_args(__doc__.splitlines()[0], argv)
    config, num_tokens, rounds = (QUICK, 256, 2) if args.quick else (FULL, 1024, 5)
    model = LlamaModel(config, random_weights(config, seed=0))
    layout = config.layout("bench-slow-tier", BLOCK_SIZE)
    prompt = torch.randint(0, config.vocab_size, (num_tokens,), generator=torch.Generator().manual_seed(3)).tolist()
    read_delay_s = SLOWDOWN * recompute_s(model, layout, prompt)
    _report.print_header(f"TTFT, {num_tokens}-token prefix only on an SSD slowed {read_delay_s * 1e3:.0f} ms per read "
                         f"(reference runner, {config.num_parameters() / 1e6:.0f} M random Llama, CPU fp32)",
                         args.quick, "timing: the runner's TTFT (admission to first token), ours and the private "
                         "recompute in each round, in alternating order; median over rounds")
    rows, goals = [], []
    for name, extra in (("declined (the default: weighed against the measured prefill)", ()),
                        ("forced in (policy.recompute_s_per_token = 1)", ALWAYS_LOAD)):
        with tempfile.TemporaryDirectory(prefix="kvb-") as directory:
            ours, baseline, num_t2_tokens = ttfts(model, layout, prompt, rounds, directory, read_delay_s, extra)
        ours_ms, baseline_ms = statistics.median(ours) * 1e3, statistics.median(baseline) * 1e3
        ratio = baseline_ms / ours_ms
        rows.append([name, f"{ours_ms:,.1f} ms", f"{num_t2_tokens // rounds:,}", f"{baseline_ms:,.1f} ms",
                     f"{ratio:.2f}x"])
        if not extra:
            goals.append((f"a declined T2 hit's TTFT against recompute: {ratio:.2f}x (goal >= 0.90x: recompute "
                          f"plus the Acquire)", ratio >= 0.9 and num_t2_tokens == 0))
    _report.print_table(["T2 hit", "TTFT, kvtierd", "T2 tokens loaded", "recompute (private pool)",
                         "recompute / kvtierd"], rows)
    _report.print_goals(goals)
    return 0


if __name__ == "__main__":
    sys.exit(main())
