"""Hashing: tokens/s of the sha256 and xxh3-128 block-hash chains beside the raw hash function.

Ours: `Namespace.hash_blocks(token_ids)` over a prompt of random token ids (block 16), given as a
list of ints (what an engine holds) and as a uint32 array. Where the package was built with a C
compiler, the chain runs in one C loop (kernels/hash_chain.c) and a list is packed in C; the
header says which loop ran (KVTIERD_PURE_PYTHON_HASH=1 times the Python loop).

Baseline ("raw"): the bare hash function, `hashlib.sha256(m).digest()` or
`xxhash.xxh3_128_digest(m)`, applied in a list comprehension to exactly the per-block messages
our chain hashes (header + tokens field + parent field), built beforehand. The ratio shows what
our chaining, framing and packing cost on top of the hash itself. Goal: ours >= 0.5x raw.

Context only, not the goal's baseline: one call of the raw function over the whole packed token
buffer as a single message, the speed of the hash without any per-block work.
"""

from __future__ import annotations

import dataclasses
import hashlib
import struct
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import _report  # noqa: E402
from kvtierd.block_hash import HEADER, KIND_BLOCK, TAG_PARENT, TAG_TOKENS, Namespace  # noqa: E402
from kvtierd.hash_chain_native import native_chain, native_pack_u32  # noqa: E402
from kvtierd.layout import llama3_8b  # noqa: E402

BLOCK_SIZE = 16
PROMPT_SIZES = (4096, 32768)
ALGOS = ("sha256", "xxh3_128")
VOCAB_SIZE = 128_256  # Llama 3
GOAL_RATIO = 0.5


def raw_function(algo: str) -> Callable[[list[bytes]], list[bytes]]:
    """The baseline: the bare hash function over each pre-built message."""
    if algo == "sha256":
        sha256 = hashlib.sha256
        return lambda messages: [sha256(m).digest() for m in messages]
    digest = xxhash.xxh3_128_digest
    return lambda messages: [digest(m) for m in messages]


def whole_buffer_function(algo: str) -> Callable[[bytes], bytes]:
    if algo == "sha256":
        return lambda data: hashlib.sha256(data).digest()
    return xxhash.xxh3_128_digest


def block_messages(namespace: Namespace, token_bytes: bytes, chain: list[bytes]) -> list[bytes]:
    """The messages the chain hashes, rebuilt from the documented encoding (version 1)."""
    stride = 4 * BLOCK_SIZE
    tokens_head = HEADER + KIND_BLOCK + struct.pack("<BI", TAG_TOKENS, stride)
    parent_head = struct.pack("<BI", TAG_PARENT, namespace.digest_size)
    parents = [namespace.root, *chain[:-1]]
    return [tokens_head + token_bytes[i * stride:(i + 1) * stride] + parent_head + parent
            for i, parent in enumerate(parents)]


@dataclasses.dataclass(frozen=True, slots=True)
class Row:
    name: str
    num_tokens: int
    ours_tokens_per_s: float
    raw_tokens_per_s: float
    ratio: float
    best_ratio: float


def tokens_per_s(num_tokens: int, ns: float) -> float:
    return num_tokens / ns * 1e9


def measure(algo: str, num_tokens: int, input_kind: str, rng: np.random.Generator, rounds: int,
            warmup: int) -> tuple[Row, float]:
    """One row, and the whole-buffer reference in tokens/s."""
    namespace = Namespace(llama3_8b(BLOCK_SIZE), tenant="bench", algo=algo)
    token_array = rng.integers(0, VOCAB_SIZE, num_tokens, dtype=np.uint32)
    token_ids = token_array.tolist() if input_kind == "list[int]" else token_array
    token_bytes = token_array.astype("<u4").tobytes()
    chain = namespace.hash_blocks(token_ids)
    messages = block_messages(namespace, token_bytes, chain)
    raw = raw_function(algo)
    assert raw(messages) == chain, "the baseline must hash exactly our messages"

    whole = whole_buffer_function(algo)
    ours, baseline, reference = _report.time_interleaved(
        [lambda: namespace.hash_blocks(token_ids), lambda: raw(messages), lambda: whole(token_bytes)],
        rounds=rounds, warmup=warmup)
    row = Row(
        name=f"{algo} chain, {input_kind}",
        num_tokens=num_tokens,
        ours_tokens_per_s=tokens_per_s(num_tokens, ours.median_ns),
        raw_tokens_per_s=tokens_per_s(num_tokens, baseline.median_ns),
        ratio=baseline.median_ns / ours.median_ns,
        best_ratio=baseline.best_ns / ours.best_ns,
    )
    return row, tokens_per_s(num_tokens, reference.median_ns)


def mtok(tokens_per_s: float) -> str:
    return f"{tokens_per_s / 1e6:,.2f}"


def main(argv: Sequence[str] | None = None) -> int:
    args = _report.parse_args(__doc__.splitlines()[0], argv)
    rng = np.random.default_rng(20240601)
    _report.print_header(f"Hashing: Namespace.hash_blocks, block {BLOCK_SIZE}, random token ids", args.quick)
    print("baseline (raw): the bare hash function (hashlib.sha256(m).digest() / xxhash.xxh3_128_digest(m)) over "
          "the exact per-block messages our chain hashes (header + tokens field + parent field), pre-built; "
          "checked equal to our chain")
    print(f"goal: ours >= {GOAL_RATIO:g}x raw (tokens/s)")
    loops = {algo: "C loop (kvtierd._hash_chain)" if native_chain(algo) else "Python loop" for algo in ALGOS}
    print("ours: " + ", ".join(f"{algo}: {loop}" for algo, loop in loops.items())
          + "; list[int] packed by " + ("C" if native_pack_u32() else "array('I')"))
    print()
    rows: list[Row] = []
    references: list[list[str]] = []
    for algo in ALGOS:
        for num_tokens in PROMPT_SIZES:
            # about the same time per row: fewer rounds for the longer prompt
            rounds = 10 if args.quick else (800 if num_tokens <= 4096 else 120)
            warmup = 2 if args.quick else rounds // 10
            for input_kind in ("list[int]", "uint32 array"):
                row, reference = measure(algo, num_tokens, input_kind, rng, rounds, warmup)
                rows.append(row)
            references.append([f"{algo}, one message of {4 * num_tokens} bytes", f"{num_tokens // 1024}k",
                               mtok(reference), mtok(rows[-1].raw_tokens_per_s)])
    _report.print_table(
        ["ours", "tokens", "ours Mtok/s", "raw Mtok/s", "ratio", "(best)", "goal", "result"],
        [[row.name, f"{row.num_tokens // 1024}k", mtok(row.ours_tokens_per_s), mtok(row.raw_tokens_per_s),
          f"{row.ratio:.2f}x", f"{row.best_ratio:.2f}x", f">= {GOAL_RATIO:g}x",
          _report.verdict(row.ratio >= GOAL_RATIO)] for row in rows])
    print()
    print("ratio = ours tokens/s over raw tokens/s (medians); result judged on the median ratio")
    print()
    print("Context, NOT the goal's baseline: the raw function called once over the whole packed token buffer")
    _report.print_table(["reference", "tokens", "whole-buffer Mtok/s", "raw per-block Mtok/s"], references)
    return 0


if __name__ == "__main__":
    sys.exit(main())
