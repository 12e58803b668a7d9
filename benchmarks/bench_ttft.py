"""Time to first token of a 2k-token shared prefix + 64 new tokens: cold, and restored from T0, T1, T2.

The reference runner (connectors/) on an 8-layer, hidden-1024 Llama with random weights, fp32
on the CPU, so that recomputing the prefix is real work. Ours: the request through a real
`kvtierd serve` whose T0/T1/T2 hold the prefix (T1: after Puts of other blocks pushed it out of
T0; T2: after a restart, which empties T0 and T1). Baseline, same machine, same run: the same
request on a private pool that recomputes everything (what a runner without kvtierd does).
Every restored request must produce the baseline's first token. Goal: a T1 hit >= 5x faster
than cold (vLLM reports 2-22x for CPU offloading on an H100).
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import _report  # noqa: E402
from kvtierd.client import KvtierClient  # noqa: E402
from kvtierd.connectors.kv_backend import PrivateKv, num_blocks_for  # noqa: E402
from kvtierd.connectors.llama_config import LlamaConfig  # noqa: E402
from kvtierd.connectors.llama_model import LlamaModel  # noqa: E402
from kvtierd.connectors.llama_weights import random_weights  # noqa: E402
from kvtierd.connectors.runner import GenerationRequest, ReferenceRunner  # noqa: E402
from kvtierd.connectors.runner_connector import KvtierdConnector  # noqa: E402
from kvtierd.daemon_process import DaemonProcess, small_daemon_args  # noqa: E402

FULL = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                   num_attention_heads=16, num_key_value_heads=8)
QUICK = LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=704, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2)
BLOCK_SIZE = 16
NUM_NEW_TOKENS = 64
PUT_CHUNK_BLOCKS = 16
GOAL_T1_SPEEDUP = 5.0


class Bench:
    def __init__(self, config: LlamaConfig, prefix_tokens: int, directory: str) -> None:
        self.config = config
        self.model = LlamaModel(config, random_weights(config, seed=0))
        self.layout = config.layout("bench-ttft-llama", BLOCK_SIZE)
        rng = np.random.default_rng(1)
        self.prefix = rng.integers(1, config.vocab_size, prefix_tokens).tolist()
        self._rng = rng
        self.num_request_blocks = num_blocks_for(prefix_tokens + NUM_NEW_TOKENS + 1, BLOCK_SIZE)
        self.directory = directory
        self.private = ReferenceRunner(self.model, PrivateKv(self.layout, self.num_request_blocks))
        self.daemon: DaemonProcess | None = None
        self.client: KvtierClient | None = None
        self.runner: ReferenceRunner | None = None
        self._next_id = 0

    def request(self, fresh_prefix: bool = False) -> GenerationRequest:
        """The shared prefix (or a fresh one, never seen before) and 64 fresh tokens."""
        self._next_id += 1
        prefix = self._rng.integers(1, self.config.vocab_size, len(self.prefix)).tolist() if fresh_prefix \
            else self.prefix
        suffix = self._rng.integers(1, self.config.vocab_size, NUM_NEW_TOKENS).tolist()
        return GenerationRequest(f"r{self._next_id}", prefix + suffix, max_new_tokens=1)

    def start_daemon(self) -> None:
        """T0 holds 2 requests, T1 6 (written through, so T1 and T2 hold every committed block)."""
        request_bytes = self.num_request_blocks * self.layout.bytes_per_block
        self.daemon = DaemonProcess(small_daemon_args(
            self.directory, t0_bytes=str(2 * request_bytes), host_bytes=str(6 * request_bytes),
            ssd_bytes=str(16 * request_bytes),
            extra=["--set", "policy.t0_to_t1=write_through", "--set", "policy.recompute_s_per_token=0"]))
        self.client = KvtierClient(self.daemon.address, timeout_s=120.0)
        self.runner = ReferenceRunner(self.model, KvtierdConnector(self.client.attach(self.layout)))

    def restart_daemon(self) -> None:
        self.client.close()
        assert self.daemon.stop() == 0
        self.start_daemon()

    def push_out_of_t0(self) -> None:
        """Put 2 requests' worth of unrelated blocks: the prefix leaves T0 (T1 and T2 keep it)."""
        num_blocks = 2 * self.num_request_blocks
        tokens = self._rng.integers(1, self.config.vocab_size, num_blocks * BLOCK_SIZE).tolist()
        hashes = self.runner.backend.session.namespace.hash_blocks(tokens)
        data = np.zeros(self.layout.bytes_per_block, dtype=np.uint8).tobytes()
        for start in range(0, num_blocks, PUT_CHUNK_BLOCKS):
            end = min(num_blocks, start + PUT_CHUNK_BLOCKS)
            blocks = [(hashes[i], tokens[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE], data) for i in range(start, end)]
            self.client.put(self.layout, blocks, hashes[start - 1] if start else None)

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
        if self.daemon is not None:
            self.daemon.stop()


def main(argv: Sequence[str] | None = None) -> int:
    args = _report.parse_args(__doc__.splitlines()[0], argv)
    config, prefix_tokens, rounds = (QUICK, 512, 2) if args.quick else (FULL, 2048, 3)
    with tempfile.TemporaryDirectory(dir=os.environ.get("KVTIERD_BENCH_DIR", "/var/tmp")) as directory:
        bench = Bench(config, prefix_tokens, directory)
        try:
            return run(bench, config, prefix_tokens, rounds, args.quick)
        finally:
            bench.close()


def run(bench: Bench, config: LlamaConfig, prefix_tokens: int, rounds: int, quick: bool) -> int:
    num_prefix_hit = prefix_tokens // BLOCK_SIZE * BLOCK_SIZE
    bench.start_daemon()
    ttft_s: dict[str, list[float]] = {"cold": [], "cold (kvtierd miss)": [], "T0 hit": [], "T1 hit": [], "T2 hit": []}

    def measure(case: str, expected_hits: tuple[int, int, int], fresh_prefix: bool = False) -> None:
        """`expected_hits` (T0, T1, T2 tokens); a request with the shared prefix commits it."""
        request = bench.request(fresh_prefix)
        baseline = bench.private.generate([request])[0]
        ttft_s["cold"].append(baseline.ttft_s)
        result = bench.runner.generate([request])[0]
        hits = (result.num_t0_hit_tokens, result.num_t1_hit_tokens, result.num_t2_hit_tokens)
        assert hits == expected_hits, (case, hits)
        assert result.output_token_ids == baseline.output_token_ids, f"{case}: first token differs from recompute"
        ttft_s[case].append(result.ttft_s)

    for round_ in range(rounds):  # misses; the last one commits the shared prefix
        measure("cold (kvtierd miss)", (0, 0, 0), fresh_prefix=round_ < rounds - 1)
    for _ in range(rounds):
        measure("T0 hit", (num_prefix_hit, 0, 0))
    for _ in range(rounds):
        bench.push_out_of_t0()
        measure("T1 hit", (0, num_prefix_hit, 0))
    for _ in range(rounds):
        bench.restart_daemon()
        measure("T2 hit", (0, 0, num_prefix_hit))

    _report.print_header(f"TTFT, {prefix_tokens}-token shared prefix + {NUM_NEW_TOKENS} new tokens: reference runner, "
                         f"{config.num_hidden_layers} layers, hidden {config.hidden_size}, "
                         f"{config.num_parameters() / 1e6:.0f} M parameters, fp32 on CPU, block {BLOCK_SIZE}", quick,
                         "timing: TTFT as the runner measures it (admission to first token: hashing, Acquire, "
                         "Wait, prefill); medians over rounds (best in brackets)")
    print("baseline: the same request recomputed on a private pool (no kvtierd), run before each of ours")
    print()
    cold = statistics.median(ttft_s["cold"])
    rows = []
    for case in ("cold (kvtierd miss)", "T0 hit", "T1 hit", "T2 hit"):
        ours = statistics.median(ttft_s[case])
        speedup = cold / ours
        goal = f">= {GOAL_T1_SPEEDUP:g}x" if case == "T1 hit" else "-"
        verdict = _report.verdict(speedup >= GOAL_T1_SPEEDUP) if case == "T1 hit" else ""
        rows.append([case, _report.median_and_best(ours * 1e3, min(ttft_s[case]) * 1e3, 1),
                     _report.median_and_best(cold * 1e3, min(ttft_s["cold"]) * 1e3, 1), f"{speedup:.2f}x", goal, verdict])
    _report.print_table(["TTFT", "ours ms", "cold recompute ms", "speedup", "goal", ""], rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
