"""Paged attention (the reference runner's) beside torch SDPA on the same KV, laid out dense.

Llama-3-8B's attention: 32 query heads, 8 KV heads of 128, block 16. On CUDA in bf16: a decode
step of 32 sequences at 4,096 keys each, the prefill of one 4,096-token prompt (causal), and the
64-token suffix of a 4,096-token prompt whose first 4,032 tokens are cached (what a prefix hit
computes). On the CPU in fp32, smaller: 8 x 2,048 keys, 1,024 tokens, 64 after 960.
Ours: `paged_attention` reading K and V from a block-major pool through shuffled block tables,
its metadata built once beforehand (the model builds it once per forward pass, for all layers):
on CUDA the decode step runs its Triton kernel (blocks read in place), the rest SDPA over the
gathered blocks; a context row on CUDA gives the decode step through SDPA too.
Baseline, same run: `torch.nn.functional.scaled_dot_product_attention` on the same K and V
gathered once, untimed, into contiguous [batch, kv_heads, keys, head_dim] tensors (enable_gqa;
is_causal for the prefill, causal_lower_right for the suffix): attention with no paging at all,
torch's fastest kernel for the shapes. Outputs are compared before timing.
Goal: ours >= 0.5x SDPA's speed for decode and prefill; the suffix is reported.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import _report  # noqa: E402
from kvtierd.connectors.reference.paged_attention import paged_attention  # noqa: E402
from kvtierd.connectors.reference.paged_attention_metadata import PagedAttentionMetadata  # noqa: E402

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
DTYPES = {"cuda": torch.bfloat16, "cpu": torch.float32}  # each device's model dtype
TOLERANCES = {torch.bfloat16: (2e-2, 1.6e-2), torch.float32: (1e-4, 1e-4)}  # (atol, rtol)
GOAL_RATIO = 0.5
# (decodes, keys per decode, prefill tokens, suffix tokens), per device: the full run, then --quick
SIZES = {"cuda": ((32, 4096, 4096, 64), (8, 1024, 1024, 64)), "cpu": ((8, 2048, 1024, 64), (4, 512, 256, 32))}


@dataclasses.dataclass
class Case:
    """One batch, paged (ours) and dense (SDPA), holding the same keys and values."""

    name: str
    judged: bool
    query: torch.Tensor  # [tokens, heads, head_dim]
    key_cache: torch.Tensor  # [blocks, block_size, kv_heads, head_dim], strided views of one pool
    value_cache: torch.Tensor
    metadata: PagedAttentionMetadata
    dense_q: torch.Tensor  # [batch, heads, queries, head_dim]
    dense_k: torch.Tensor  # [batch, kv_heads, keys, head_dim]
    dense_v: torch.Tensor
    mask: object  # None (decode), "causal" (prefill) or a CausalBias (suffix)
    triton_decode: bool = True

    def ours(self) -> torch.Tensor:
        return paged_attention(self.query, self.key_cache, self.value_cache, self.metadata,
                               triton_decode=self.triton_decode)

    def sdpa(self) -> torch.Tensor:
        if self.mask == "causal":
            return F.scaled_dot_product_attention(self.dense_q, self.dense_k, self.dense_v, is_causal=True,
                                                  enable_gqa=True)
        return F.scaled_dot_product_attention(self.dense_q, self.dense_k, self.dense_v, attn_mask=self.mask,
                                              enable_gqa=True)


def make_case(name: str, num_seqs: int, num_keys: int, num_queries: int, judged: bool, device: str,
              seed: int) -> Case:
    """`num_seqs` sequences of `num_keys` keys, the last `num_queries` of each as queries."""
    dtype = DTYPES[device]
    generator = torch.Generator(device=device).manual_seed(seed)
    blocks_per_seq = num_keys // BLOCK_SIZE
    num_blocks = num_seqs * blocks_per_seq
    pool = torch.randn(num_blocks, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, device=device, generator=generator,
                       dtype=dtype)
    tables = torch.randperm(num_blocks, device=device, generator=generator).view(num_seqs, blocks_per_seq)
    query = torch.randn(num_seqs * num_queries, NUM_HEADS, HEAD_DIM, device=device, generator=generator, dtype=dtype)
    metadata = PagedAttentionMetadata.build(tables.tolist(), [num_keys] * num_seqs,
                                            [s * num_queries for s in range(num_seqs + 1)], BLOCK_SIZE, device)

    def dense(kv: int) -> torch.Tensor:  # [seqs, blocks, block_size, kv_heads, dim] -> [seqs, kv_heads, keys, dim]
        return pool[tables.flatten(), kv].view(num_seqs, num_keys, NUM_KV_HEADS, HEAD_DIM).transpose(1, 2).contiguous()

    dense_q = query.view(num_seqs, num_queries, NUM_HEADS, HEAD_DIM).transpose(1, 2).contiguous()
    if num_queries == 1:
        mask = None
    elif num_queries == num_keys:
        mask = "causal"
    else:
        mask = causal_lower_right(num_queries, num_keys)
    return Case(name, judged, query, pool[:, 0], pool[:, 1], metadata, dense_q, dense(0), dense(1), mask)


def check_same_attention(case: Case) -> None:
    ours = case.ours()
    expected = case.sdpa().transpose(1, 2).reshape(ours.shape)
    atol, rtol = TOLERANCES[ours.dtype]
    torch.testing.assert_close(ours.float(), expected.float(), atol=atol, rtol=rtol)


def parse_args(argv: Sequence[str] | None):
    parser = _report.argument_parser(__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu",
                        help="where to run (default: cuda when present)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_paged_attention: --device cuda, but torch.cuda.is_available() is false")
    rounds, warmup = (3, 1) if args.quick else (20, 3)
    num_decodes, decode_keys, prefill_tokens, suffix_tokens = SIZES[device][args.quick]
    decode = make_case(f"decode, {num_decodes} x {decode_keys} keys", num_decodes, decode_keys, 1, True, device, 1)
    cases = [decode,
             make_case(f"prefill, {prefill_tokens} tokens", 1, prefill_tokens, prefill_tokens, True, device, 2),
             make_case(f"suffix, {suffix_tokens} tokens after {prefill_tokens - suffix_tokens} cached", 1,
                       prefill_tokens, suffix_tokens, False, device, 3)]
    if device == "cuda":
        cases.insert(1, dataclasses.replace(decode, name=f"{decode.name}, SDPA over gathered blocks", judged=False,
                                            triton_decode=False))
    where = torch.cuda.get_device_name() if device == "cuda" else f"the CPU ({torch.get_num_threads()} threads)"
    _report.print_header(f"Paged attention on {where}: {NUM_HEADS} heads / {NUM_KV_HEADS} KV heads of {HEAD_DIM}, "
                         f"block {BLOCK_SIZE}, {str(DTYPES[device]).removeprefix('torch.')}", args.quick)
    print("baseline: torch scaled_dot_product_attention (enable_gqa) on the same K/V, gathered dense once, untimed")
    print(f"goal: decode and prefill >= {GOAL_RATIO:g}x SDPA; the suffix is reported")
    print()
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    rows = []
    for case in cases:
        check_same_attention(case)

        def ours(case: Case = case) -> None:
            case.ours()
            sync()

        def sdpa(case: Case = case) -> None:
            case.sdpa()
            sync()

        ours_t, base_t = _report.time_pair(ours, sdpa, rounds=rounds, warmup=warmup)
        ratio = base_t.median_ns / ours_t.median_ns
        rows.append([case.name, _report.median_and_best(ours_t.median_ns / 1e6, ours_t.best_ns / 1e6, 3),
                     _report.median_and_best(base_t.median_ns / 1e6, base_t.best_ns / 1e6, 3), f"{ratio:.2f}x",
                     f">= {GOAL_RATIO:g}x" if case.judged else "-",
                     _report.verdict(ratio >= GOAL_RATIO) if case.judged else ""])
    _report.print_table(["attention", "ours ms", "SDPA ms", "ratio", "goal", "result"], rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())

