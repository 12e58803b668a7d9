"""Time to first token of a long shared prefix: cold, and restored from T0, T1, T2, beside the fastest recompute.

Two row sets from one run, both on the reference runner (connectors/), fp32 on the CPU:
1. SmolLM2-135M-Instruct (real weights, fetched once like `kvtierd demo`): a real chat prompt of
   about 2k tokens (the demo's help-desk system prompt, then a user message pasting documents),
   each request ending in another question. Goal: a T1 hit >= 8x faster than recompute.
2. a random-weight Llama of 8 layers, hidden 1024 (160 M parameters): 2,048 random tokens + 64
   new ones. Goal: a T1 hit >= 5x faster than recompute.
Ours: the request through a real `kvtierd serve` whose T0/T1/T2 hold the prefix (T1: after Puts
of other blocks pushed it out of T0; T2: after a restart, which empties T0 and T1), told to load
every hit (policy.recompute_s_per_token = 1 s: by default a hit slower than recompute is
declined, and its row would time a recompute). Baseline, same machine, same run, measured
before each of ours: the FASTEST recompute of the same model with the same weights, of two: the
reference runner on a private pool that recomputes everything (what a runner without kvtierd
does), and transformers' LlamaForCausalLM with SDPA attention (prefill of the last position's
logits, no cache). Every restored request must produce the
recompute's first token (in bf16/fp16: one the recompute scores within 5 % of its best logit).
(vLLM reports 2-22x for CPU offloading on an H100.)

`--cuda` (the GPU acceptance run) is `--device cuda --dtype bfloat16`: only a random-weight Llama
the shape of TinyLlama-1.1B (22 layers, hidden 2048, 32 heads / 4 KV heads, 1.1 B parameters),
bf16 on cuda:0, a 4,096-token prefix + 64 new tokens, the daemon's pool in GPU memory and T1
page-locked. `--device` / `--dtype` alone run that row set where asked (`--device cpu --dtype
bfloat16`: the same code path on the CPU, with the 160 M Llama and a 2,048-token prefix). Goal:
a T1 hit >= 5x faster than the fastest recompute.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import _report  # noqa: E402
from benchmarks._recompute_baselines import TransformersRecompute, agrees  # noqa: E402
from kvtierd.client import KvtierClient  # noqa: E402
from kvtierd.connectors.demo import demo_texts  # noqa: E402
from kvtierd.connectors.demo.model_fetch import fetch_model  # noqa: E402
from kvtierd.connectors.reference.kv_backend import PrivateKv, num_blocks_for  # noqa: E402
from kvtierd.connectors.reference.llama_config import LlamaConfig  # noqa: E402
from kvtierd.connectors.reference.llama_model import LlamaModel  # noqa: E402
from kvtierd.connectors.reference.llama_weights import random_weights  # noqa: E402
from kvtierd.connectors.reference.model_files import load_model_files  # noqa: E402
from kvtierd.connectors.reference.runner import GenerationRequest, ReferenceRunner  # noqa: E402
from kvtierd.connectors.reference.runner_connector import KvtierdConnector  # noqa: E402
from kvtierd.launch.daemon_process import ONE_LAYOUT, DaemonProcess, small_daemon_args  # noqa: E402

FULL = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                   num_attention_heads=16, num_key_value_heads=8)
TINYLLAMA = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                        num_attention_heads=32, num_key_value_heads=4)  # TinyLlama-1.1B's shape
CUDA_PREFIX_TOKENS = 4096
QUICK = LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=704, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2)
BLOCK_SIZE = 16
NUM_NEW_TOKENS = 64
PUT_CHUNK_BLOCKS = 16
RECOMPUTES = ("reference runner (private pool)", "transformers, SDPA")  # the baseline: the faster of the two


class RandomPrompts:
    """A shared prefix of random token ids, then NUM_NEW_TOKENS fresh ones per request."""

    def __init__(self, vocab_size: int, prefix_tokens: int) -> None:
        self._rng = np.random.default_rng(1)
        self.vocab_size = vocab_size
        self.prefix = self._tokens(prefix_tokens)
        self.description = f"{prefix_tokens}-token shared prefix + {NUM_NEW_TOKENS} new tokens (random ids)"

    def _tokens(self, num_tokens: int) -> list[int]:
        return self._rng.integers(1, self.vocab_size, num_tokens).tolist()

    def max_prompt_tokens(self) -> int:
        return len(self.prefix) + NUM_NEW_TOKENS

    def prompt(self, fresh_prefix: bool) -> list[int]:
        prefix = self._tokens(len(self.prefix)) if fresh_prefix else self.prefix
        return prefix + self._tokens(NUM_NEW_TOKENS)


class ChatPrompts:
    """A real chat prompt through the model's template: the demo's system prompt, a user message
    pasting `num_documents` documents, then "<Name> asks: <question>". Every request has a name of
    its own (first letters A..Z: the prompts part at the name's first token, so the shared prefix
    is the same for all). A fresh prefix starts the system prompt with a line of its own."""

    NAMES = ["Ana", "Bruno", "Chen", "Dara", "Emil", "Farah", "Goran", "Hana", "Ivan", "Jonas", "Kemal", "Lucia",
             "Mateo", "Nadia", "Oskar", "Priya", "Quinn", "Rosa", "Sami", "Tariq", "Umar", "Vera", "Wanda", "Xenia",
             "Yusuf", "Zora"]

    def __init__(self, tokenizer, num_documents: int) -> None:
        self.tokenizer = tokenizer
        self.documents = "".join(c[0].rsplit("\n\n", 1)[0] + "\n\n" for c in demo_texts.CONVERSATIONS[:num_documents])
        self._num_prompts = 0
        self.prefix = os.path.commonprefix([self._prompt(0, False), self._prompt(1, False)])
        self.description = (f"real chat prompt of ~{len(self._prompt(0, False))} tokens (system prompt, "
                            f"{num_documents} pasted documents, a question; {len(self.prefix)} tokens shared)")

    def _prompt(self, index: int, fresh_prefix: bool) -> list[int]:
        system = (f"Conversation {index}.\n" if fresh_prefix else "") + demo_texts.SYSTEM_PROMPT
        name, question = self.NAMES[index % len(self.NAMES)], demo_texts.QUESTIONS[index % len(demo_texts.QUESTIONS)]
        return self.tokenizer.prompt([{"role": "system", "content": system},
                                      {"role": "user", "content": f"{self.documents}{name} asks: {question}"}])

    def max_prompt_tokens(self) -> int:
        return max(len(self._prompt(i, True)) for i in range(len(demo_texts.QUESTIONS)))

    def prompt(self, fresh_prefix: bool) -> list[int]:
        assert self._num_prompts < len(self.NAMES), "names repeat: a prompt would hit another's blocks"
        self._num_prompts += 1
        return self._prompt(self._num_prompts, fresh_prefix)


class Bench:
    """One model's row set: the daemon and its runner, and the two recompute baselines.

    `transformers` holds the same weights as `model` (so its first tokens are comparable)."""

    def __init__(self, model: LlamaModel, model_id: str, prompts, transformers: TransformersRecompute) -> None:
        self.config = model.config
        self.model = model
        self.dtype_name = str(model.dtype).removeprefix("torch.")
        self.layout = self.config.layout(model_id, BLOCK_SIZE, self.dtype_name)
        self.prompts = prompts
        self.transformers = transformers
        self._rng = np.random.default_rng(2)
        self.num_request_blocks = num_blocks_for(prompts.max_prompt_tokens() + 1, BLOCK_SIZE)
        self.directory = ""
        self.private = ReferenceRunner(self.model, PrivateKv(self.layout, self.num_request_blocks, model.device),
                                       record_logits=True)
        self.daemon: DaemonProcess | None = None
        self.client: KvtierClient | None = None
        self.runner: ReferenceRunner | None = None
        self._next_id = 0

    @property
    def exact(self) -> bool:
        """fp32: first tokens must be equal; bf16/fp16: within the logit margin (agrees())."""
        return self.model.dtype == torch.float32

    def request(self, fresh_prefix: bool = False) -> GenerationRequest:
        """The shared prefix (or a fresh one, never seen before) and new tokens."""
        self._next_id += 1
        return GenerationRequest(f"r{self._next_id}", self.prompts.prompt(fresh_prefix), max_new_tokens=1)

    def start_daemon(self) -> None:
        """T0 holds 2 requests, T1 6 (written through, so T1 and T2 hold every committed block)."""
        request_bytes = self.num_request_blocks * self.layout.bytes_per_block
        self.daemon = DaemonProcess(small_daemon_args(
            self.directory, t0_bytes=str(2 * request_bytes), host_bytes=str(6 * request_bytes),
            ssd_bytes=str(16 * request_bytes),
            extra=[*ONE_LAYOUT, "--device", str(self.model.device), "--set", "policy.t0_to_t1=write_through",
                   "--set", "policy.recompute_s_per_token=1"]))  # load every hit: each row times its tier
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


def parse_args(argv: Sequence[str] | None):
    parser = _report.argument_parser(__doc__.splitlines()[0])
    parser.add_argument("--cuda", action="store_true",
                        help="the GPU row set: --device cuda --dtype bfloat16 (a 1.1 B random Llama on cuda:0)")
    parser.add_argument("--device", choices=("cpu", "cuda"),
                        help="only the random-Llama row set, on this device (with --dtype)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                        help="the model's and the KV cache's dtype for --device (default bfloat16)")
    args = parser.parse_args(argv)
    if args.cuda:
        if args.device not in (None, "cuda"):
            parser.error("--cuda is --device cuda")
        args.device = "cuda"
    if args.dtype is not None and args.device is None:
        parser.error("--dtype goes with --device (the default row sets are fp32 on the CPU)")
    if args.device is not None:
        args.dtype = args.dtype or "bfloat16"
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda, but torch.cuda.is_available() is false")
    return args


def random_llama(config: LlamaConfig, device: str, dtype: torch.dtype) -> tuple[LlamaModel, TransformersRecompute]:
    """The reference runner's model and transformers' with the same random weights, drawn on `device`."""
    weights = random_weights(config, seed=0, dtype=dtype, device=device)
    model = LlamaModel(config, weights, device=device, dtype=dtype)
    return model, TransformersRecompute(config, weights, device, dtype)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    rounds = 2 if args.quick else 3
    if args.device is not None:
        dtype = getattr(torch, args.dtype)
        if args.quick:
            config, prefix_tokens = QUICK, 512
        elif args.device == "cuda":
            config, prefix_tokens = TINYLLAMA, CUDA_PREFIX_TOKENS
        else:
            config, prefix_tokens = FULL, 2048
        model, transformers = random_llama(config, args.device, dtype)
        prompts = RandomPrompts(config.vocab_size, prefix_tokens)
        bench = Bench(model, f"bench-ttft-llama-{args.device}-{args.dtype}", prompts, transformers)
        return run_in_temporary_directory(bench, rounds, 5.0, args.quick)
    gguf = fetch_model(progress=lambda line: print(line, file=sys.stderr, flush=True))
    files = load_model_files(gguf)
    chat = ChatPrompts(files.tokenizer, 0 if args.quick else 3)
    smollm2 = Bench(LlamaModel(files.config, files.weights), files.name, chat,
                    TransformersRecompute(files.config, files.weights, "cpu", torch.float32))
    config = QUICK if args.quick else FULL
    model, transformers = random_llama(config, "cpu", torch.float32)
    llama = Bench(model, "bench-ttft-llama", RandomPrompts(config.vocab_size, 512 if args.quick else 2048),
                  transformers)
    for bench, goal in ((smollm2, 8.0), (llama, 5.0)):
        run_in_temporary_directory(bench, rounds, goal, args.quick)
        print()
    return 0


def run_in_temporary_directory(bench: Bench, rounds: int, goal_t1_speedup: float, quick: bool) -> int:
    """`run` with the daemon's socket and SSD files in a temporary directory (KVTIERD_BENCH_DIR or /var/tmp)."""
    with tempfile.TemporaryDirectory(dir=os.environ.get("KVTIERD_BENCH_DIR", "/var/tmp")) as directory:
        bench.directory = directory
        try:
            run(bench, rounds, goal_t1_speedup, quick)
        finally:
            bench.close()
    return 0


def run(bench: Bench, rounds: int, goal_t1_speedup: float, quick: bool) -> None:
    num_prefix_hit = len(bench.prompts.prefix) // BLOCK_SIZE * BLOCK_SIZE
    config = bench.config
    bench.start_daemon()
    ttft_s: dict[str, list[float]] = {name: [] for name in (*RECOMPUTES, "cold (kvtierd miss)", "T0 hit", "T1 hit",
                                                            "T2 hit")}

    def measure(case: str, expected_hits: tuple[int, int, int], fresh_prefix: bool = False) -> None:
        """`expected_hits` (T0, T1, T2 tokens); a request with the shared prefix commits it."""
        request = bench.request(fresh_prefix)
        recompute = bench.private.generate([request])[0]
        recompute_logits = recompute.step_logits[0][0]
        ttft_s[RECOMPUTES[0]].append(recompute.ttft_s)
        if not quick or case == "cold (kvtierd miss)":  # --quick: the smoke test's minutes
            token, transformers_s, _ = bench.transformers.first_token(request.prompt_token_ids)
            assert agrees(token, recompute_logits, bench.exact), f"{case}: transformers' first token differs"
            ttft_s[RECOMPUTES[1]].append(transformers_s)
        result = bench.runner.generate([request])[0]
        hits = (result.num_t0_hit_tokens, result.num_t1_hit_tokens, result.num_t2_hit_tokens)
        assert hits == expected_hits, (case, hits)
        assert agrees(result.output_token_ids[0][0], recompute_logits, bench.exact), \
            f"{case}: first token differs from recompute"
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

    _report.print_header(f"TTFT, {bench.prompts.description}: reference runner on {bench.layout.model_id}, "
                         f"{config.num_hidden_layers} layers, hidden {config.hidden_size}, "
                         f"{config.num_parameters() / 1e6:.0f} M parameters, {bench.dtype_name} on "
                         f"{bench.model.device}, block {BLOCK_SIZE}", quick,
                         "timing: TTFT as the runner measures it (admission to first token: hashing, Acquire, "
                         "Wait, prefill); medians over rounds (best in brackets)")
    medians = {name: statistics.median(ttft_s[name]) for name in RECOMPUTES}
    fastest = min(RECOMPUTES, key=medians.__getitem__)
    when = "before each of ours" + (" (transformers: before the cold ones)" if quick else "")
    print(f"baseline: the fastest recompute of the same model, measured {when}: {fastest} "
          f"(transformers {bench.transformers.version})")
    print()
    _report.print_table(["recompute (baseline candidates)", "ms", ""],
                        [[name, _report.median_and_best(medians[name] * 1e3, min(ttft_s[name]) * 1e3, 1),
                          "fastest" if name == fastest else ""] for name in RECOMPUTES])
    print()
    baseline = medians[fastest]
    rows = []
    for case in ("cold (kvtierd miss)", "T0 hit", "T1 hit", "T2 hit"):
        ours = statistics.median(ttft_s[case])
        speedup = baseline / ours
        goal = f">= {goal_t1_speedup:g}x" if case == "T1 hit" else "-"
        verdict = _report.verdict(speedup >= goal_t1_speedup) if case == "T1 hit" else ""
        rows.append([case, _report.median_and_best(ours * 1e3, min(ttft_s[case]) * 1e3, 1),
                     _report.median_and_best(baseline * 1e3, min(ttft_s[fastest]) * 1e3, 1), f"{speedup:.2f}x", goal,
                     verdict])
    _report.print_table(["TTFT", "ours ms", "fastest recompute ms", "speedup", "goal", ""], rows)


if __name__ == "__main__":
    sys.exit(main())
