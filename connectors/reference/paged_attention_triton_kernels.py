"""The two Triton kernels of paged_attention_triton.py (imported only where Triton is).

Layouts: the query `[seqs, heads, head_dim]`; the caches `[blocks, block_size, kv_heads,
head_dim]` with any strides but a contiguous last dim; the block tables `[seqs, columns]`
(int64; only the entries of a sequence's context are read); the scratch buffers `[seqs, heads,
splits, head_dim]` and `[seqs, heads, splits]` in fp32. Log-sum-exps are in base 2 (the scale
comes in multiplied by log2(e)).
"""

from __future__ import annotations

import triton  # pyright: ignore[reportMissingImports]  # torch's CUDA wheels bring it; not the CPU's
import triton.language as tl  # pyright: ignore[reportMissingImports]


@triton.jit
def decode_split_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, part_out_ptr, part_lse_ptr,
                        scale_log2, keys_per_split,
                        q_stride_seq, q_stride_head, cache_stride_block, cache_stride_row, cache_stride_head,
                        table_stride, part_stride_seq, part_stride_head, part_stride_split,
                        lse_stride_seq, lse_stride_head,
                        GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                        BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """One (sequence, KV head, split): the GROUP query heads of that KV head over keys
    [split * keys_per_split, min(next split, context_len))."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(lens_ptr + seq).to(tl.int32)
    start = split * keys_per_split
    end = tl.minimum(start + keys_per_split, context_len)

    rows = tl.arange(0, BLOCK_H)
    row_mask = rows < GROUP
    heads = kv_head * GROUP + rows
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    q = tl.load(q_ptr + seq * q_stride_seq + heads[:, None] * q_stride_head + dims[None, :],
                mask=row_mask[:, None] & dim_mask[None, :], other=0.0)

    running_max = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    running_sum = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    table = tables_ptr + seq.to(tl.int64) * table_stride
    for first in range(start, end, BLOCK_N):
        keys = first + tl.arange(0, BLOCK_N)
        key_mask = keys < end
        blocks = tl.load(table + keys // BLOCK_SIZE, mask=key_mask, other=0).to(tl.int64)
        offsets = blocks * cache_stride_block + (keys % BLOCK_SIZE) * cache_stride_row + kv_head * cache_stride_head
        kv_mask = key_mask[:, None] & dim_mask[None, :]
        k = tl.load(k_ptr + offsets[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        scores = tl.dot(q, tl.trans(k)) * scale_log2
        scores = tl.where(key_mask[None, :], scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, 1))
        correction = tl.exp2(running_max - new_max)
        weights = tl.exp2(scores - new_max[:, None])
        running_sum = running_sum * correction + tl.sum(weights, 1)
        v = tl.load(v_ptr + offsets[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        acc = acc * correction[:, None] + tl.dot(weights.to(v.dtype), v)
        running_max = new_max

    has_keys = running_sum > 0  # a split past a short context has none
    out = acc / tl.where(has_keys, running_sum, 1.0)[:, None]
    lse = tl.where(has_keys, running_max + tl.log2(tl.where(has_keys, running_sum, 1.0)), float("-inf"))
    part = seq.to(tl.int64) * part_stride_seq + heads * part_stride_head + split * part_stride_split
    tl.store(part_out_ptr + part[:, None] + dims[None, :], out, mask=row_mask[:, None] & dim_mask[None, :])
    tl.store(part_lse_ptr + seq.to(tl.int64) * lse_stride_seq + heads * lse_stride_head + split, lse, mask=row_mask)


@triton.jit
def merge_splits_kernel(part_out_ptr, part_lse_ptr, out_ptr, num_splits,
                        part_stride_seq, part_stride_head, part_stride_split, lse_stride_seq, lse_stride_head,
                        out_stride_seq, out_stride_head,
                        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
    """One (sequence, query head): its splits' outputs weighted by 2^(lse - max lse)."""
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, BLOCK_S)
    split_mask = splits < num_splits
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    lse = tl.load(part_lse_ptr + seq * lse_stride_seq + head * lse_stride_head + splits,
                  mask=split_mask, other=float("-inf"))
    weights = tl.where(split_mask, tl.exp2(lse - tl.max(lse, 0)), 0.0)
    parts = tl.load(part_out_ptr + seq * part_stride_seq + head * part_stride_head
                    + splits[:, None] * part_stride_split + dims[None, :],
                    mask=split_mask[:, None] & dim_mask[None, :], other=0.0)
    out = tl.sum(parts * weights[:, None], 0) / tl.sum(weights, 0)  # pyright: ignore[reportOperatorIssue]
    tl.store(out_ptr + seq * out_stride_seq + head * out_stride_head + dims, out.to(out_ptr.dtype.element_ty),
             mask=dim_mask)
