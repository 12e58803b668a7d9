"""The CUDA paged-attention kernel beside torch SDPA on the same KV, at Llama-3-8B's sizes.
Needs CUDA and CuPy (the GPU acceptance run).

Llama-3-8B's attention (32 query heads, 8 KV heads of 128, block 16), bf16, two cases: a decode
step of 32 sequences at 4,096 keys each, and the prefill of one 4,096-token prompt (causal).
Ours: `paged_attention_cuda` reading K and V in place from a block-major pool through shuffled
block tables. Baseline, same run: `torch.nn.functional.scaled_dot_product_attention`
(enable_gqa, torch's fastest backend for the shapes) on the same K and V gathered once, untimed,
into dense [batch, kv_heads, keys, head_dim] tensors: attention with no paging at all. Both
outputs are checked against each other before timing.
Goal (decode): ours >= 0.25x SDPA's speed. The kernel runs a thread block per (query token,
head) and reads a KV head once per query head (4 times at GQA 4:1), dense SDPA once per KV head:
0.25x is the bandwidth bound of that design. The prefill is reported.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import _report  # noqa: E402

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
DTYPE = torch.bfloat16
ATOL, RTOL = 8e-3, 1.6e-2  # bf16, as tests/connectors/reference/test_paged_attention_cuda.py
GOAL_DECODE_RATIO = 0.25


@dataclasses.dataclass
class Case:
    """One batch, paged (ours) and dense (SDPA), holding the same keys and values."""

    name: str
    paged_args: tuple
    dense_q: torch.Tensor  # [batch, heads, queries, head_dim]
    dense_k: torch.Tensor  # [batch, kv_heads, keys, head_dim]
    dense_v: torch.Tensor
    causal: bool

    def ours(self) -> torch.Tensor:
        from kvtierd.connectors.reference.paged_attention_cuda import paged_attention_cuda

        return paged_attention_cuda(*self.paged_args)

    def sdpa(self) -> torch.Tensor:
        return F.scaled_dot_product_attention(self.dense_q, self.dense_k, self.dense_v, is_causal=self.causal,
                                              enable_gqa=True)


def make_case(name: str, num_seqs: int, num_keys: int, num_queries: int, seed: int) -> Case:
    """`num_seqs` sequences of `num_keys` keys, the last `num_queries` of each as queries."""
    generator = torch.Generator(device="cuda").manual_seed(seed)
    blocks_per_seq = num_keys // BLOCK_SIZE
    num_blocks = num_seqs * blocks_per_seq
    pool = torch.randn(num_blocks, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, device="cuda", generator=generator,
                       dtype=DTYPE)
    tables = torch.randperm(num_blocks, device="cuda", generator=generator).view(num_seqs, blocks_per_seq)
    query = torch.randn(num_seqs * num_queries, NUM_HEADS, HEAD_DIM, device="cuda", generator=generator, dtype=DTYPE)
    context_lens = torch.full((num_seqs,), num_keys, dtype=torch.int32, device="cuda")
    starts = torch.arange(0, num_seqs + 1, dtype=torch.int32, device="cuda") * num_queries
    paged_args = (query, pool[:, 0], pool[:, 1], tables.to(torch.int32), context_lens, starts, 1 / math.sqrt(HEAD_DIM))

    def dense(kv: int) -> torch.Tensor:  # [seqs, blocks, block_size, kv_heads, dim] -> [seqs, kv_heads, keys, dim]
        return pool[tables.flatten(), kv].view(num_seqs, num_keys, NUM_KV_HEADS, HEAD_DIM).transpose(1, 2).contiguous()

    dense_q = query.view(num_seqs, num_queries, NUM_HEADS, HEAD_DIM).transpose(1, 2).contiguous()
    return Case(name, paged_args, dense_q, dense(0), dense(1), causal=num_queries > 1)


def check_same_attention(case: Case) -> None:
    ours = case.ours()
    expected = case.sdpa().transpose(1, 2).reshape(ours.shape)
    torch.testing.assert_close(ours.float(), expected.float(), atol=ATOL, rtol=RTOL)


def main(argv: Sequence[str] | None = None) -> int:
    args = _report.parse_args(__doc__.splitlines()[0], argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_paged_attention: needs CUDA (torch.cuda.is_available() is false)")
    rounds, warmup = (3, 1) if args.quick else (20, 3)
    num_keys = 1024 if args.quick else 4096
    cases = [make_case(f"decode, 32 x {num_keys} keys", 32, num_keys, 1, seed=1),
             make_case(f"prefill, 1 x {num_keys} tokens", 1, num_keys, num_keys, seed=2)]
    _report.print_header(f"Paged attention on {torch.cuda.get_device_name()}: {NUM_HEADS} heads / {NUM_KV_HEADS} KV "
                         f"heads of {HEAD_DIM}, block {BLOCK_SIZE}, {str(DTYPE).removeprefix('torch.')}", args.quick)
    print("baseline: torch scaled_dot_product_attention (enable_gqa) on the same K/V, gathered dense once, untimed")
    print(f"goal: decode >= {GOAL_DECODE_RATIO:g}x SDPA (its bandwidth bound); prefill reported")
    print()
    rows = []
    for case in cases:
        check_same_attention(case)

        def ours(case: Case = case) -> None:
            case.ours()
            torch.cuda.synchronize()

        def sdpa(case: Case = case) -> None:
            case.sdpa()
            torch.cuda.synchronize()

        ours_t, base_t = _report.time_pair(ours, sdpa, rounds=rounds, warmup=warmup)
        ratio = base_t.median_ns / ours_t.median_ns
        is_decode = not case.causal
        rows.append([case.name, _report.median_and_best(ours_t.median_ns / 1e6, ours_t.best_ns / 1e6, 3),
                     _report.median_and_best(base_t.median_ns / 1e6, base_t.best_ns / 1e6, 3), f"{ratio:.2f}x",
                     f">= {GOAL_DECODE_RATIO:g}x" if is_decode else "-",
                     _report.verdict(ratio >= GOAL_DECODE_RATIO) if is_decode else ""])
    _report.print_table(["attention", "ours ms", "SDPA ms", "ratio", "goal", "result"], rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
