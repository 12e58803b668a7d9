"""`kvtierd demo`: the reference runner with and without kvtierd, turn by turn.

Every turn of the demo traffic (demo_workload.py) runs twice on the same model: on a private
pool that recomputes the whole prompt ("without kvtierd"), and through the daemon, which
restores whatever prefix it holds from T0, T1 or T2 ("with"). The demo prints each turn's time
to first token both ways, the hit tokens per tier, and whether the two generations are token
for token identical; then the daemon's tier stats. It starts its own daemon, sized so that T0
and T1 overflow (or uses a running one with `--address`).
"""

from __future__ import annotations

import dataclasses
import tempfile

from kvtierd.client import KvtierClient
from kvtierd.connectors.demo_workload import DemoTraffic, DemoTurn, DemoWorkload
from kvtierd.connectors.kv_backend import PrivateKv, num_blocks_for
from kvtierd.connectors.llama_config import LlamaConfig
from kvtierd.connectors.llama_model import LlamaModel
from kvtierd.connectors.llama_weights import load_weights, random_weights
from kvtierd.connectors.runner import GenerationRequest, ReferenceRunner
from kvtierd.connectors.runner_connector import KvtierdConnector
from kvtierd.daemon_process import DaemonProcess, small_daemon_args

DEMO_MODEL = LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=4)


@dataclasses.dataclass(frozen=True, slots=True)
class DemoOptions:
    workload: DemoWorkload = DemoWorkload()
    model: LlamaConfig = DEMO_MODEL
    weights_path: str | None = None  # safetensors file or directory; None: random weights from `seed`
    model_id: str = "kvtierd-demo-llama"
    seed: int = 0
    block_size: int = 16
    address: str | None = None  # a running daemon; None: start one
    t0_blocks: int = 96  # of the demo's own daemon: smaller than the traffic's working set
    t1_blocks: int = 128
    t2_bytes: str = "1GiB"


@dataclasses.dataclass(frozen=True, slots=True)
class TurnReport:
    phase: str
    label: str
    num_prompt_tokens: int
    num_t0_hit_tokens: int
    num_t1_hit_tokens: int
    num_t2_hit_tokens: int
    num_computed_tokens: int
    ttft_without_s: float
    ttft_with_s: float
    same_output: bool


@dataclasses.dataclass(frozen=True, slots=True)
class TierReport:
    tier: str
    capacity_bytes: int
    num_cached_blocks: int
    num_hit_blocks: int
    num_evictions: int


@dataclasses.dataclass(frozen=True, slots=True)
class DemoReport:
    model: str
    daemon: str
    turns: list[TurnReport]
    tiers: list[TierReport]
    num_leaked_blocks: int  # blocks still held after every request was released

    @property
    def all_same(self) -> bool:
        return all(turn.same_output for turn in self.turns)


def build_model(options: DemoOptions) -> LlamaModel:
    if options.weights_path:
        return LlamaModel(options.model, load_weights(options.weights_path, options.model))
    return LlamaModel(options.model, random_weights(options.model, seed=options.seed))


def daemon_args(options: DemoOptions, directory: str) -> list[str]:
    """A daemon whose T0 and T1 are smaller than the demo's traffic, so hits come from every tier."""
    bytes_per_block = options.model.layout(options.model_id, options.block_size).bytes_per_block
    return small_daemon_args(directory, t0_bytes=str(options.t0_blocks * bytes_per_block),
                             host_bytes=str(options.t1_blocks * bytes_per_block), ssd_bytes=options.t2_bytes,
                             extra=["--set", "policy.recompute_s_per_token=0"])


def run_demo(options: DemoOptions, progress=None) -> DemoReport:
    """Run the traffic; `progress(turn_report)` is called after each turn."""
    model = build_model(options)
    with tempfile.TemporaryDirectory(prefix="kvtierd-demo-") as directory:
        daemon = None if options.address else DaemonProcess(daemon_args(options, directory))
        try:
            address = options.address or daemon.address
            with KvtierClient(address, timeout_s=60.0) as client:
                return _run(options, model, client, address, progress)
        finally:
            if daemon is not None:
                daemon.stop()


def _run(options: DemoOptions, model: LlamaModel, client: KvtierClient, address: str, progress) -> DemoReport:
    layout = options.model.layout(options.model_id, options.block_size)
    traffic = DemoTraffic(options.workload)
    session = client.attach(layout)
    with_kvtierd = ReferenceRunner(model, KvtierdConnector(session))
    num_private_blocks = num_blocks_for(traffic.max_prompt_tokens() + options.workload.reply_tokens + 1,
                                        options.block_size)
    without = ReferenceRunner(model, PrivateKv(layout, num_private_blocks, model.device))
    turns = []
    for turn in traffic.turns():
        report, output = _run_turn(turn, without, with_kvtierd)
        traffic.reply(turn, output)
        turns.append(report)
        if progress is not None:
            progress(report)
    stats = client.stats()
    pool = next(p for p in stats.pools if p.layout.model_id == options.model_id)
    tiers = [TierReport(t.tier, t.capacity_bytes, t.num_cached_blocks, t.num_hit_blocks, t.num_evictions)
             for t in pool.tiers]
    session.close()
    model_line = (f"{options.model.num_hidden_layers} layers, hidden {options.model.hidden_size}, "
                  f"{options.model.num_attention_heads} heads / {options.model.num_key_value_heads} KV heads, "
                  f"{options.model.num_parameters() / 1e6:.1f} M parameters, fp32, block {options.block_size}")
    return DemoReport(model_line, address, turns, tiers, pool.num_blocks - pool.num_free_blocks)


def _run_turn(turn: DemoTurn, without: ReferenceRunner, with_kvtierd: ReferenceRunner) -> tuple[TurnReport, list[int]]:
    request = GenerationRequest(turn.request_id, turn.prompt_token_ids, turn.max_new_tokens)
    baseline = without.generate([request])[0]
    result = with_kvtierd.generate([request])[0]
    report = TurnReport(turn.phase, turn.label, result.num_prompt_tokens, result.num_t0_hit_tokens,
                        result.num_t1_hit_tokens, result.num_t2_hit_tokens, result.num_computed_prompt_tokens,
                        baseline.ttft_s, result.ttft_s, result.output_token_ids == baseline.output_token_ids)
    return report, result.output_token_ids[0]


TURN_HEADER = (f"{'phase':<13} {'turn':<15} {'prompt':>6} {'hit T0':>6} {'hit T1':>6} {'hit T2':>6} "
               f"{'computed':>8} {'TTFT without':>12} {'TTFT with':>10} {'speedup':>7}  same output")


def turn_line(t: TurnReport) -> str:
    return (f"{t.phase:<13} {t.label:<15} {t.num_prompt_tokens:>6} {t.num_t0_hit_tokens:>6} {t.num_t1_hit_tokens:>6} "
            f"{t.num_t2_hit_tokens:>6} {t.num_computed_tokens:>8} {t.ttft_without_s * 1e3:>9.1f} ms "
            f"{t.ttft_with_s * 1e3:>7.1f} ms {t.ttft_without_s / t.ttft_with_s:>6.1f}x  "
            f"{'yes' if t.same_output else 'NO'}")


def summary_lines(report: DemoReport) -> list[str]:
    turns = report.turns
    num_prompt = sum(t.num_prompt_tokens for t in turns)
    hits = [sum(getattr(t, f"num_{tier}_hit_tokens") for t in turns) for tier in ("t0", "t1", "t2")]
    without_s = sum(t.ttft_without_s for t in turns)
    with_s = sum(t.ttft_with_s for t in turns)
    lines = [
        "",
        f"{len(turns)} turns, {num_prompt:,} prompt tokens: {sum(hits):,} restored ({100 * sum(hits) / num_prompt:.0f} %: "
        f"T0 {hits[0]:,}, T1 {hits[1]:,}, T2 {hits[2]:,}), {num_prompt - sum(hits):,} computed",
        f"time to first token, all turns: {without_s:.2f} s without kvtierd, {with_s:.2f} s with "
        f"({without_s / with_s:.1f}x); generations identical: "
        f"{sum(t.same_output for t in turns)} of {len(turns)}",
        "",
        f"{'tier':<5} {'capacity':>12} {'cached blocks':>13} {'hit blocks':>10} {'evictions':>9}",
    ]
    lines += [f"{t.tier:<5} {t.capacity_bytes / 2**20:>8.1f} MiB {t.num_cached_blocks:>13} {t.num_hit_blocks:>10} "
              f"{t.num_evictions:>9}" for t in report.tiers]
    lines.append(f"blocks still held after the demo: {report.num_leaked_blocks}")
    return lines
