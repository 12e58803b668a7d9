"""Decode steps on CUDA: a Triton kernel that reads K and V in place through the block tables.

For a group of sequences with one query each, SDPA over gathered blocks (paged_attention.py)
moves every key three times (the gather reads and writes it, SDPA reads the copy) where
attention on a dense cache reads it once; a decode step is nothing but that read. This kernel
reads each key once, split-K ("flash decoding"):

- stage 1, grid (sequences, KV heads, splits): the query heads of one KV head (packed as the
  rows of one `tl.dot`) against one slice of the context, each key row loaded from its block in
  place (any block stride: the caches are views of the block-major pool), an online softmax in
  fp32 (base 2), the partial output and its log-sum-exp written to a scratch buffer;
- stage 2, grid (sequences, query heads): the splits merged by their log-sum-exps.

Used by `paged_attention` for bf16 and fp16 on CUDA where Triton imports (it ships with
torch's CUDA wheels); fp32, the CPU and CUDA without Triton take the SDPA path. With
TRITON_INTERPRET=1 set before the import, Triton's interpreter runs the same kernel on the CPU.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import os
from typing import Any

import torch

from kvtierd.connectors.reference.paged_attention_metadata import AttentionGroup

DTYPES = (torch.bfloat16, torch.float16)
MAX_HEAD_DIM = 256
KEYS_PER_TILE = 64  # keys per loop step of a split (BLOCK_N)
MIN_KEYS_PER_SPLIT = 256
PROGRAMS_PER_SM = 2  # splits are added until the grid has this many programs per SM
MAX_SPLITS = 64
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def uses_triton_decode(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> bool:
    """True when `paged_decode_triton` takes these tensors (else the SDPA path runs)."""
    return ((query.is_cuda or INTERPRETED) and query.dtype in DTYPES and key_cache.dtype == query.dtype
            and query.shape[-1] <= MAX_HEAD_DIM and key_cache.stride(-1) == 1 and query.stride(-1) == 1
            and key_cache.stride() == value_cache.stride() and triton_available())


def num_splits(num_seqs: int, num_kv_heads: int, max_context_len: int, device: torch.device) -> int:
    """Enough splits to fill the GPU's SMs, each of at least MIN_KEYS_PER_SPLIT keys."""
    num_sms = _num_sms(device.index if device.index is not None else torch.cuda.current_device()) \
        if device.type == "cuda" else 4
    wanted = math.ceil(PROGRAMS_PER_SM * num_sms / (num_seqs * num_kv_heads))
    return max(1, min(wanted, math.ceil(max_context_len / MIN_KEYS_PER_SPLIT), MAX_SPLITS))


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def paged_decode_triton(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                        group: AttentionGroup, scale: float) -> torch.Tensor:
    """The decode group's output `[num_seqs, num_heads, head_dim]`; `query` is its `[num_seqs,
    num_heads, head_dim]` rows. Asynchronous on torch's current stream."""
    from kvtierd.connectors.reference import paged_attention_triton_kernels as kernels

    assert group.num_queries == 1 and not group.causal, "a decode group"
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    group_size = num_heads // num_kv_heads
    splits = num_splits(num_seqs, num_kv_heads, group.num_keys, query.device)
    keys_per_split = math.ceil(math.ceil(group.num_keys / splits) / KEYS_PER_TILE) * KEYS_PER_TILE
    partial_out = torch.empty(num_seqs, num_heads, splits, head_dim, dtype=torch.float32, device=query.device)
    partial_lse = torch.empty(num_seqs, num_heads, splits, dtype=torch.float32, device=query.device)
    out = torch.empty_like(query)
    block_tables = group.block_ids.view(num_seqs, -1)
    block_d = max(16, triton_next_power_of_2(head_dim))  # tl.dot takes no dim below 16
    launcher(kernels.decode_split_kernel, (num_seqs, num_kv_heads, splits))(
        query, key_cache, value_cache, block_tables, group.context_lens, partial_out, partial_lse,
        scale * math.log2(math.e), keys_per_split,
        query.stride(0), query.stride(1), *key_cache.stride()[:3], block_tables.stride(0),
        *partial_out.stride()[:3], *partial_lse.stride()[:2],
        GROUP=group_size, BLOCK_H=max(16, triton_next_power_of_2(group_size)), HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_SIZE=block_size, BLOCK_N=KEYS_PER_TILE, num_warps=4, num_stages=2)
    launcher(kernels.merge_splits_kernel, (num_seqs, num_heads))(
        partial_out, partial_lse, out, splits, *partial_out.stride()[:3], *partial_lse.stride()[:2],
        out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=max(2, triton_next_power_of_2(splits)), num_warps=4)
    return out


def launcher(kernel: Any, grid: tuple[int, ...]) -> Any:
    """`kernel[grid]`, untyped: how triton types a kernel's launcher changes between its releases."""
    return kernel[grid]


def triton_next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()
