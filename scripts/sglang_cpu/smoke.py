"""Smoke check of .venv-sglang (scripts/install-sglang-cpu): real SGLang with HiCache on this CPU.

    .venv-sglang/bin/python scripts/sglang_cpu/smoke.py [--keep DIR]

Writes a tiny Llama with real random weights (transformers' LlamaForCausalLM(config) and its default
init, through tests/connectors/vllm/model_kinds.py's write_model) and a word-level tokenizer into a
temporary directory, starts `sglang.Engine` on it with HiCache (the host tier, L2) and the "file"
storage backend (L3) in that directory, sends one 300-token prompt twice (greedy, a few tokens) and
checks that the second request reports cached tokens and the same output. Prints the engine's start
time. Exit 0 when it all holds.

The Engine kwargs this SGLang (0.5.23) is run with on a CPU (ENGINE_KWARGS below), and why. Required:
device, attention_backend, disable_cuda_graph, disable_overlap_schedule, max_total_tokens,
enable_hierarchical_cache, hicache_io_backend, hicache_mem_layout (an engine with only these, page_size
and log_level started and hit its device cache here); mem_fraction_static and hicache_ratio are
belt and braces; the storage ones are what this check is about.
  device="cpu"                           no CUDA: SGLang picks the CPU platform
  attention_backend="torch_native"       the only attention backend with no compiled kernel
  disable_cuda_graph=True                no CUDA graphs on the CPU
  disable_overlap_schedule=True          the overlap scheduler needs CUDA streams
  max_total_tokens=4096                  the device KV pool's size in tokens; without it SGLang
                                         sizes the pool from a fraction of "GPU" memory (all of RAM)
  mem_fraction_static=0.5                (optional) a fixed share for the memory estimate
  enable_hierarchical_cache=True         HiCache: the host (CPU DRAM) tier behind the device pool
  hicache_io_backend="direct"            the copy between device and host pools in torch ops (the
                                         "kernel" backend is a CUDA kernel)
  hicache_mem_layout="layer_first"       the host layout the "direct" backend copies per layer
  hicache_ratio=2.0                      the host pool: twice the device pool. 2.0 is the default,
                                         but only an explicit ratio (or hicache_size, in GB) turns off
                                         the auto-sizing by hicache_host_memory_fraction, which keeps
                                         10 GiB of host RAM free and may shrink the pool on a small box
  page_size=16                           tokens per page; HiCache and storage move whole pages
  hicache_storage_backend="file"         the L3 tier: files in extra config's file_storage_path
  hicache_storage_backend_extra_config   a JSON *string*, not a dict
  hicache_write_policy="write_through"   every page goes to host (and on to storage) when computed
  hicache_storage_prefetch_policy="wait_complete"  a request waits for its storage prefetch
  log_level="error", random_seed=0       quiet, reproducible
And in the environment, before sglang is imported: SGLANG_USE_CPU_ENGINE=1 (SGLang's is_cpu() is
false without it, and a machine without CUDA then takes neither path).

A dynamic backend instead: hicache_storage_backend="dynamic" and
hicache_storage_backend_extra_config='{"backend_name": "x", "module_path": "pkg.mod",
"class_name": "Cls", "interface_v1": 1}' (the class subclasses
sglang.srt.mem_cache.hicache_storage.HiCacheStorage; the module must import in the scheduler process).

Each result's meta_info has "cached_tokens" (prompt tokens not computed) and, in this version,
"cached_tokens_details" (where they came from: device, host, storage).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]

PROMPT_TOKENS = 300
MAX_NEW_TOKENS = 4
VOCAB_WORDS = 509  # + 3 special tokens = a vocabulary of 512
# initializer_range 0.1, not 0.02: attention that is not near-uniform, so that a wrong KV page changes
# the greedy output (tests/connectors/vllm/model_kinds.py says the same of vLLM's kinds).
LLAMA_FIELDS = dict(vocab_size=VOCAB_WORDS + 3, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                    bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=0.1)

ENGINE_KWARGS = dict(
    device="cpu",
    attention_backend="torch_native",
    disable_cuda_graph=True,
    disable_overlap_schedule=True,
    max_total_tokens=4096,
    mem_fraction_static=0.5,
    enable_hierarchical_cache=True,
    hicache_io_backend="direct",
    hicache_mem_layout="layer_first",
    hicache_ratio=2.0,
    page_size=16,
    hicache_write_policy="write_through",
    hicache_storage_prefetch_policy="wait_complete",
    log_level="error",
    random_seed=0,
)


def write_tokenizer(directory: pathlib.Path) -> None:
    """A word-level tokenizer ("<unk>", "<s>", "</s>", "w0".."w508", split on whitespace), saved by
    transformers' PreTrainedTokenizerFast.save_pretrained (tokenizer.json and its config)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i + 3 for i in range(VOCAB_WORDS)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>", pad_token="<unk>")
    fast.save_pretrained(directory)


def write_tiny_llama(directory: pathlib.Path, **fields) -> None:
    """config.json + model.safetensors (bf16, LlamaForCausalLM's own init from a fixed seed) + tokenizer;
    `fields` change LLAMA_FIELDS (a benchmark's larger model)."""
    sys.path.insert(0, str(ROOT))
    from tests.connectors.vllm.model_kinds import ModelKind, write_model

    kind = ModelKind("llama-sglang-smoke", "tiny Llama for the SGLang smoke check", "LlamaConfig",
                     "LlamaForCausalLM", {**LLAMA_FIELDS, **fields})
    write_model(kind, str(directory))
    write_tokenizer(directory)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", type=pathlib.Path, help="work in this directory (model, storage) and keep it")
    args = parser.parse_args()

    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
        return check(args.keep)
    with tempfile.TemporaryDirectory(prefix="sglang-smoke-") as work:
        return check(pathlib.Path(work))


def check(work: pathlib.Path) -> int:
    """The model in WORK/model, the file backend's storage in WORK/l3; 0 when every check holds."""
    model_dir = work / "model"
    write_tiny_llama(model_dir)

    import sglang

    kwargs = dict(ENGINE_KWARGS, model_path=str(model_dir),
                  hicache_storage_backend="file",
                  hicache_storage_backend_extra_config=json.dumps({"file_storage_path": str(work / "l3")}))
    prompt = " ".join(f"w{(7 * i) % VOCAB_WORDS}" for i in range(PROMPT_TOKENS))
    full_pages = PROMPT_TOKENS // ENGINE_KWARGS["page_size"] * ENGINE_KWARGS["page_size"]
    problems = []

    # Engine 1: the prompt twice; the second finds it in the device pool (radix cache).
    first, second = run_engine(sglang, kwargs, prompt, 2, "engine 1")
    if first["meta_info"]["prompt_tokens"] != PROMPT_TOKENS:
        problems.append(f"prompt_tokens {first['meta_info']['prompt_tokens']}, expected {PROMPT_TOKENS}")
    if first["meta_info"]["cached_tokens"] != 0:
        problems.append(f"the first request found {first['meta_info']['cached_tokens']} cached tokens in a new engine")
    if second["meta_info"]["cached_tokens"] < full_pages - ENGINE_KWARGS["page_size"]:
        problems.append(f"the second request found only {second['meta_info']['cached_tokens']} cached tokens")

    # Engine 2, a new process on the same storage directory: its device and host pools are empty, so the
    # prefix can only come from storage (HiCache L3, written through by engine 1).
    (third,) = run_engine(sglang, kwargs, prompt, 1, "engine 2")
    storage_hits = (third["meta_info"].get("cached_tokens_details") or {}).get("storage", 0)
    if storage_hits < full_pages - ENGINE_KWARGS["page_size"]:
        problems.append(f"a new engine read only {storage_hits} prompt tokens from storage")

    texts = [out["text"] for out in (first, second, third)]
    if len(set(texts)) != 1:
        problems.append(f"greedy outputs differ: {texts}")
    for problem in problems:
        print(f"smoke: {problem}", file=sys.stderr)
    print("smoke: ok" if not problems else "smoke: FAILED", flush=True)
    return 1 if problems else 0


def run_engine(sglang, kwargs: dict, prompt: str, times: int, name: str) -> list[dict]:
    """Starts an Engine, sends the prompt `times` times (greedy), shuts it down; the results."""
    started = time.monotonic()
    engine = sglang.Engine(**kwargs)
    print(f"{name}: start {time.monotonic() - started:.1f} s", flush=True)
    outputs = []
    try:
        sampling = {"temperature": 0.0, "max_new_tokens": MAX_NEW_TOKENS, "ignore_eos": True}
        for attempt in range(times):
            started = time.monotonic()
            out = engine.generate(prompt=prompt, sampling_params=sampling)
            meta = out["meta_info"]
            print(f"{name}: request {attempt + 1}: {time.monotonic() - started:.2f} s, "
                  f"prompt_tokens={meta['prompt_tokens']}, cached_tokens={meta['cached_tokens']}, "
                  f"cached_tokens_details={meta.get('cached_tokens_details')}, output={out['text']!r}", flush=True)
            outputs.append(out)
    finally:
        engine.shutdown()
    return outputs


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # SGLang's is_cpu() is true only with this set (before sglang is imported): without it a machine
    # without CUDA takes neither the CUDA nor the CPU path (e.g. RoPE imports vllm._custom_ops).
    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
    sys.exit(main())
