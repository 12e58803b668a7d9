"""`kvtierd demo`: the reference runner with and without kvtierd, turn by turn.

Every turn of the demo traffic (demo_workload.py) runs twice on the same model: on a private
pool that recomputes the whole prompt ("without kvtierd"), and through the daemon, which
restores whatever prefix it holds from T0, T1 or T2 ("with"). The demo prints each turn's time
to first token both ways, the hit tokens per tier, whether the two generations are token for
token identical, and the first words of the reply; then the daemon's tier stats. It starts its
own daemon, sized so that T0 and T1 overflow (or uses a running one with `--address`).

The model is SmolLM2-135M-Instruct by default (fetched once, model_fetch.py), any Llama GGUF
file or Hugging Face directory with `model_path`, or a small random-weight Llama with
`random_weights` (fast, for tests: its messages are random token ids).
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

from kvtierd.client import KvtierClient
from kvtierd.connectors.demo.demo_workload import DemoChat, DemoTraffic, DemoWorkload, RandomTokenChat, TemplateChat
from kvtierd.connectors.demo.model_fetch import fetch_model
from kvtierd.connectors.reference.kv_backend import PrivateKv, num_blocks_for
from kvtierd.connectors.reference.llama_config import LlamaConfig
from kvtierd.connectors.reference.llama_model import LlamaModel
from kvtierd.connectors.reference.llama_weights import random_weights
from kvtierd.connectors.reference.model_files import load_model_files
from kvtierd.connectors.reference.runner import GenerationRequest, ReferenceRunner
from kvtierd.connectors.reference.runner_connector import KvtierdConnector
from kvtierd.launch.daemon_process import DaemonProcess, small_daemon_args

RANDOM_MODEL = LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                           num_attention_heads=8, num_key_value_heads=4)
# The chat traffic on SmolLM2 (blocks of 737,280 bytes in fp32): the system prompt and a
# question fill 70 blocks; T0 holds one such request and a little more, T1 less than the chat
# phase, so histories come back from T1 and the system prompt, at the end, from T2.
CHAT_WORKLOAD = DemoWorkload(num_conversations=4, num_turns=3, num_shared_requests=3, reply_tokens=20)
CHAT_T0_BLOCKS, CHAT_T1_BLOCKS = 80, 48
RANDOM_T0_BLOCKS, RANDOM_T1_BLOCKS = 96, 128


@dataclasses.dataclass(frozen=True, slots=True)
class DemoOptions:
    workload: DemoWorkload = CHAT_WORKLOAD
    model_path: str | None = None  # a GGUF file or a Hugging Face directory; None: SmolLM2, fetched once
    random_weights: bool = False  # a random-weight `random_model` instead, messages of random token ids
    random_model: LlamaConfig = RANDOM_MODEL
    model_cache: str | None = None  # where SmolLM2 is fetched to (model_fetch.default_cache_dir())
    seed: int = 0
    block_size: int = 16
    address: str | None = None  # a running daemon; None: start one
    t0_blocks: int = CHAT_T0_BLOCKS  # of the demo's own daemon: smaller than the traffic's working set
    t1_blocks: int = CHAT_T1_BLOCKS
    t2_bytes: str = "1GiB"


@dataclasses.dataclass(frozen=True, slots=True)
class DemoModel:
    model: LlamaModel
    chat: DemoChat
    model_id: str  # the layout's model id
    description: str

    @property
    def config(self) -> LlamaConfig:
        return self.model.config


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
    reply: str  # the reply's text ("" for random weights)


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


def _describe(config: LlamaConfig, name: str, source: str) -> str:
    return (f"{name} ({source}): {config.num_hidden_layers} layers, hidden {config.hidden_size}, "
            f"{config.num_attention_heads} heads / {config.num_key_value_heads} KV heads, "
            f"{config.num_parameters() / 1e6:.1f} M parameters, fp32")


def build_model(options: DemoOptions, say=print) -> DemoModel:
    """The demo's model and the chat that writes its messages; `say` gets progress lines."""
    if options.random_weights:
        config = options.random_model
        model = LlamaModel(config, random_weights(config, seed=options.seed))
        return DemoModel(model, RandomTokenChat(dataclasses.replace(options.workload, vocab_size=config.vocab_size)),
                         "kvtierd-demo-llama", _describe(config, "random Llama", f"seed {options.seed}"))
    path = options.model_path or fetch_model(Path(options.model_cache) if options.model_cache else None, say)
    say(f"kvtierd demo: loading {path} (dequantized to fp32)")
    files = load_model_files(path)
    model = LlamaModel(files.config, files.weights)
    source = "GGUF" if str(path).endswith(".gguf") else "safetensors"
    return DemoModel(model, TemplateChat(files.tokenizer, options.workload), files.name,
                     _describe(files.config, files.name, source))


def daemon_args(options: DemoOptions, layout, directory: str) -> list[str]:
    """A daemon whose T0 and T1 are smaller than the demo's traffic, so hits come from every tier."""
    return small_daemon_args(directory, t0_bytes=str(options.t0_blocks * layout.bytes_per_block),
                             host_bytes=str(options.t1_blocks * layout.bytes_per_block), ssd_bytes=options.t2_bytes,
                             extra=["--set", "pool.max_layouts=1"])  # one layout: T1 is all its own


def run_demo(options: DemoOptions, progress=None, say=print) -> DemoReport:
    """Run the traffic; `progress(turn_report)` is called after each turn, `say(line)` on the way."""
    demo_model = build_model(options, say)
    layout = demo_model.config.layout(demo_model.model_id, options.block_size)
    with tempfile.TemporaryDirectory(prefix="kvtierd-demo-") as directory:
        daemon = None if options.address else DaemonProcess(daemon_args(options, layout, directory))
        try:
            address = daemon.address if daemon is not None else options.address
            assert address, "a running daemon was named, or one was started"
            with KvtierClient(address, timeout_s=60.0) as client:
                return _run(options, demo_model, layout, client, address, progress, say)
        finally:
            if daemon is not None:
                daemon.stop()


class _Recompute:
    """The "without kvtierd" side: a private pool that grows to the longest turn seen."""

    def __init__(self, model: LlamaModel, layout) -> None:
        self.model, self.layout = model, layout
        self.runner: ReferenceRunner | None = None

    def generate(self, request: GenerationRequest):
        num_blocks = num_blocks_for(len(request.prompt_token_ids) + request.max_new_tokens + 1, self.layout.block_size)
        if self.runner is None or self.runner.backend.pool.shape[0] < num_blocks:
            self.runner = ReferenceRunner(self.model, PrivateKv(self.layout, 2 * num_blocks, self.model.device))
        return self.runner.generate([request])[0]


def _run(options: DemoOptions, demo_model: DemoModel, layout, client: KvtierClient, address: str, progress,
         say) -> DemoReport:
    traffic = DemoTraffic(options.workload, demo_model.chat)
    session = client.attach(layout)
    with_kvtierd = ReferenceRunner(demo_model.model, KvtierdConnector(session))
    without = _Recompute(demo_model.model, layout)
    without.generate(GenerationRequest("warm-up", [1] * (2 * options.block_size), 2))  # torch's first-call costs
    say(f"kvtierd demo: {demo_model.description}; daemon at {address}; every turn runs without kvtierd "
        f"(full recompute), then with it")
    say(TURN_HEADER)
    turns = []
    for turn in traffic.turns():
        request = GenerationRequest(turn.request_id, turn.prompt_token_ids, turn.max_new_tokens,
                                    stop_token_id=demo_model.chat.stop_token_id)
        baseline = without.generate(request)
        result = with_kvtierd.generate([request])[0]
        output = result.output_token_ids[0]
        report = TurnReport(turn.phase, turn.label, result.num_prompt_tokens, result.num_t0_hit_tokens,
                            result.num_t1_hit_tokens, result.num_t2_hit_tokens, result.num_computed_prompt_tokens,
                            baseline.ttft_s, result.ttft_s, result.output_token_ids == baseline.output_token_ids,
                            demo_model.chat.reply_text(output))
        traffic.reply(turn, output)
        turns.append(report)
        if progress is not None:
            progress(report)
    stats = client.stats()
    pool = next(p for p in stats.pools if p.layout.model_id == demo_model.model_id)
    tiers = [TierReport(t.tier, t.capacity_bytes, t.num_cached_blocks, t.num_hit_blocks, t.num_evictions)
             for t in pool.tiers]
    session.close()
    return DemoReport(f"{demo_model.description}, block {options.block_size}", address, turns, tiers,
                      pool.num_blocks - pool.num_free_blocks)


TURN_HEADER = (f"{'phase':<13} {'turn':<15} {'prompt':>6} {'hit T0':>6} {'hit T1':>6} {'hit T2':>6} "
               f"{'computed':>8} {'TTFT without':>12} {'TTFT with':>10} {'speedup':>7}  same  reply")
REPLY_PREVIEW_CHARS = 48


def reply_preview(text: str) -> str:
    """The reply's first words, on one line, cut at a word boundary."""
    flat = " ".join(text.split())
    if len(flat) <= REPLY_PREVIEW_CHARS:
        return flat
    return flat[:REPLY_PREVIEW_CHARS].rsplit(" ", 1)[0] + " ..."


def turn_line(t: TurnReport) -> str:
    return (f"{t.phase:<13} {t.label:<15} {t.num_prompt_tokens:>6} {t.num_t0_hit_tokens:>6} {t.num_t1_hit_tokens:>6} "
            f"{t.num_t2_hit_tokens:>6} {t.num_computed_tokens:>8} {t.ttft_without_s * 1e3:>9.1f} ms "
            f"{t.ttft_with_s * 1e3:>7.1f} ms {t.ttft_without_s / t.ttft_with_s:>6.1f}x  "
            f"{'yes ' if t.same_output else 'NO  '}  {reply_preview(t.reply)}").rstrip()


def summary_lines(report: DemoReport) -> list[str]:
    turns = report.turns
    num_prompt = sum(t.num_prompt_tokens for t in turns)
    hits = [sum(getattr(t, f"num_{tier}_hit_tokens") for t in turns) for tier in ("t0", "t1", "t2")]
    without_s = sum(t.ttft_without_s for t in turns)
    with_s = sum(t.ttft_with_s for t in turns)
    lines = [
        "",
        f"{len(turns)} turns, {num_prompt:,} prompt tokens: {sum(hits):,} restored "
        f"({100 * sum(hits) / num_prompt:.0f} %: "
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
