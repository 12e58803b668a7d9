"""Throughput of N conversations x M turns, with kvtierd and without.

The reference runner (the demo's 4-layer, hidden-512 Llama, fp32 on CPU) serves the demo's chat
traffic (connectors/demo/demo_workload.py): each prompt the whole history plus a new message, each
reply generated; turn t of half the conversations is one batch, prefilled and decoded
together, then turn t of the other half. Ours: through a real `kvtierd serve` whose T0 holds
one batch, so each half's history comes back from T1 on its next turn. Baseline, same machine, same
run: the same turns on a private pool that recomputes every prompt. Both must generate the same
tokens. Figure: prompt + generated tokens per second of wall time, and requests per second.
"""

from __future__ import annotations

import dataclasses
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import _report  # noqa: E402
from kvtierd.client import KvtierClient  # noqa: E402
from kvtierd.connectors.demo.demo import RANDOM_MODEL, DemoOptions, daemon_args  # noqa: E402
from kvtierd.connectors.demo.demo_workload import DemoTraffic, DemoWorkload, RandomTokenChat  # noqa: E402
from kvtierd.connectors.reference.kv_backend import PrivateKv, num_blocks_for  # noqa: E402
from kvtierd.connectors.reference.llama_model import LlamaModel  # noqa: E402
from kvtierd.connectors.reference.llama_weights import random_weights  # noqa: E402
from kvtierd.connectors.reference.runner import GenerationRequest, ReferenceRunner  # noqa: E402
from kvtierd.connectors.reference.runner_connector import KvtierdConnector  # noqa: E402
from kvtierd.launch.daemon_process import DaemonProcess  # noqa: E402

TIMING = ("timing: wall time of all turns, one pass each (the conversations depend on their own replies); "
          "ours and the baseline run back to back on the same model")


@dataclasses.dataclass(slots=True)
class Pass:
    seconds: float
    num_tokens: int  # prompt + generated
    num_requests: int
    num_hit_tokens: int
    outputs: list[list[int]]


def serve_traffic(runner: ReferenceRunner, workload: DemoWorkload) -> Pass:
    """Turn t of half the conversations as one batch (prefilled together, decoded together), then
    turn t of the other half: T0 holds one batch, so each half's history waits in T1 meanwhile."""
    traffic = DemoTraffic(workload, RandomTokenChat(workload))  # the same tokens on every pass
    turns = traffic.turns()
    outputs, num_tokens, num_hits = [], 0, 0
    batch_size = max(1, workload.num_conversations // 2)
    started = time.perf_counter()
    for _ in range(workload.num_turns * workload.num_conversations // batch_size):
        batch = [next(turns) for _ in range(batch_size)]  # drawn after the replies they follow
        results = runner.generate([GenerationRequest(t.request_id, t.prompt_token_ids, t.max_new_tokens)
                                   for t in batch])
        for turn, result in zip(batch, results):
            traffic.reply(turn, result.output_token_ids[0])
            outputs.append(result.output_token_ids[0])
            num_tokens += result.num_prompt_tokens + len(result.output_token_ids[0])
            num_hits += result.num_hit_tokens
    return Pass(time.perf_counter() - started, num_tokens, len(outputs), num_hits, outputs)


def main(argv: Sequence[str] | None = None) -> int:
    args = _report.parse_args(__doc__.splitlines()[0], argv)
    num_conversations, num_turns = (2, 2) if args.quick else (8, 4)
    model_config = dataclasses.replace(RANDOM_MODEL, num_hidden_layers=2, hidden_size=256, intermediate_size=704,
                                       num_attention_heads=4, num_key_value_heads=2, vocab_size=4096) \
        if args.quick else RANDOM_MODEL
    workload = DemoWorkload(num_conversations=num_conversations, num_turns=num_turns, num_shared_requests=0,
                            first_turn_tokens=384, user_tokens=96, reply_tokens=16, vocab_size=model_config.vocab_size)
    longest_prompt = workload.first_turn_tokens + (num_turns - 1) * (workload.user_tokens + workload.reply_tokens)
    num_request_blocks = num_blocks_for(longest_prompt + workload.reply_tokens + 1, 16)
    num_batch_blocks = num_request_blocks * max(1, num_conversations // 2)  # what one batch holds
    options = DemoOptions(workload=workload, random_weights=True, random_model=model_config,
                          t0_blocks=num_batch_blocks + 8, t1_blocks=num_request_blocks * num_conversations * 2)
    model = LlamaModel(model_config, random_weights(model_config, seed=0))
    layout = model_config.layout("bench-chat-llama", options.block_size)

    baseline = serve_traffic(ReferenceRunner(model, PrivateKv(layout, num_batch_blocks)), workload)
    with tempfile.TemporaryDirectory(prefix="kvtierd-bench-") as directory:
        with DaemonProcess(daemon_args(options, layout, directory)) as daemon, KvtierClient(daemon.address) as client:
            ours = serve_traffic(ReferenceRunner(model, KvtierdConnector(client.attach(layout))), workload)
    assert ours.outputs == baseline.outputs, "kvtierd changed a generation"
    assert ours.num_tokens == baseline.num_tokens

    _report.print_header(f"Chat throughput: {num_conversations} conversations x {num_turns} turns, "
                         f"{model_config.num_hidden_layers}-layer hidden-{model_config.hidden_size} Llama, "
                         f"fp32 on CPU, batches of {max(1, num_conversations // 2)}, "
                         f"T0 of {options.t0_blocks} blocks (one batch)", args.quick, TIMING)
    print(f"baseline: the same turns on a private pool, every prompt recomputed; {ours.num_tokens:,} tokens, "
          f"{ours.num_hit_tokens:,} of them restored by kvtierd; generations identical")
    print()
    rows = [
        ["tokens/s", f"{ours.num_tokens / ours.seconds:,.0f}", f"{baseline.num_tokens / baseline.seconds:,.0f}",
         f"{baseline.seconds / ours.seconds:.2f}x", "> 1x", _report.verdict(ours.seconds < baseline.seconds)],
        ["requests/s", f"{ours.num_requests / ours.seconds:.2f}", f"{baseline.num_requests / baseline.seconds:.2f}",
         f"{baseline.seconds / ours.seconds:.2f}x", "", ""],
    ]
    _report.print_table(["throughput", "with kvtierd", "without", "ratio", "goal", ""], rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
