"""Paged attention: causal attention whose keys and values live in blocks named by block tables.

The cache of one layer is a view of the daemon's block-major pool (docs/architecture.md §3):
`key_cache = pool[:, layer, 0]`, shape `[num_blocks, block_size, num_kv_heads, head_dim]`,
with a block stride (not contiguous). Token `t` of sequence `s` lives in block
`block_tables[s, t // block_size]`, row `t % block_size`.

A batch is "varlen": the queries of all sequences are concatenated, sequence `s` owning rows
`query_start_loc[s]:query_start_loc[s + 1]`. Its `context_lens[s]` counts every token with KV
in the cache, the new ones included, so the queries of sequence `s` sit at positions
`context_lens[s] - num_queries_s ... context_lens[s] - 1`, and each attends to the positions up
to its own (causal, bottom-right aligned). Prefill, prefill of an uncached suffix and decode are
one case.

`paged_kv_cache.write_kv` stores new K and V into their slots; `paged_attention` reads them back:
per group of sequences (paged_attention_metadata.py), one gather of the group's blocks into
dense `[seqs, kv_heads, keys, head_dim]` views, then torch's `scaled_dot_product_attention` in
the query's dtype (fp32 accumulation inside; flash or memory-efficient attention on CUDA, its
fused CPU kernel on the CPU). The same code runs on every device, but for decode steps in
bf16/fp16 on CUDA, which paged_attention_triton.py's kernel computes reading the blocks in place.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kvtierd.connectors.reference.paged_attention_metadata import AttentionGroup, PagedAttentionMetadata
from kvtierd.connectors.reference.paged_attention_triton import paged_decode_triton, uses_triton_decode
from kvtierd.connectors.reference.paged_kv_cache import check_cache_pair
from kvtierd.errors import InvalidArgument

_WIDE_DTYPE = torch.int64  # blocks are gathered as 8-byte words: a quarter of the elements of bf16


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    metadata: PagedAttentionMetadata, scale: float | None = None, *,
                    triton_decode: bool = True) -> torch.Tensor:
    """Attention output `[num_tokens, num_heads, head_dim]`, in the query's dtype, for the varlen
    `query` the metadata describes (see the module doc).

    Grouped-query attention: query head `h` reads KV head `h // (num_heads // num_kv_heads)`.
    Decode groups run paged_attention_triton.py's kernel where it takes the tensors (bf16/fp16 on
    CUDA with Triton) unless `triton_decode` is False; everything else runs SDPA.
    """
    check_cache_pair(key_cache, value_cache)
    if query.dim() != 3:
        raise InvalidArgument(f"query must be [num_tokens, num_heads, head_dim], got {tuple(query.shape)}")
    num_tokens, num_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, cache_head_dim = key_cache.shape
    if num_kv_heads == 0 or num_heads % num_kv_heads or cache_head_dim != head_dim:
        raise InvalidArgument(f"{num_heads} query heads of {head_dim} cannot read {num_kv_heads} KV heads "
                              f"of {cache_head_dim}")
    if num_tokens != metadata.num_tokens or block_size != metadata.block_size:
        raise InvalidArgument(f"the metadata describes {metadata.num_tokens} query tokens in blocks of "
                              f"{metadata.block_size}, got {num_tokens} tokens and blocks of {block_size}")
    if metadata.max_block_id >= num_blocks:
        raise InvalidArgument(f"block ids must be in [0, {num_blocks}), the batch reads block {metadata.max_block_id}")
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    triton_decode = triton_decode and uses_triton_decode(query, key_cache, value_cache)
    if len(metadata.groups) == 1 and _covers(metadata.groups[0].token_rows, num_tokens):
        return _attend(query, key_cache, value_cache, metadata.groups[0], scale, triton_decode)
    out = torch.empty_like(query)
    for group in metadata.groups:
        rows = group.token_rows
        if isinstance(rows, slice):
            out[rows] = _attend(query[rows], key_cache, value_cache, group, scale, triton_decode)
        else:
            attended = _attend(query.index_select(0, rows), key_cache, value_cache, group, scale, triton_decode)
            out.index_copy_(0, rows, attended)
    return out


def paged_attention_varlen(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_tables, context_lens, query_start_loc, scale: float | None = None, *,
                           triton_decode: bool = True) -> torch.Tensor:
    """`paged_attention` with its metadata built here from the batch's tensors (read back to the
    host once): for one call; a model builds the metadata once per forward pass instead."""
    metadata = PagedAttentionMetadata.build(block_tables, context_lens, query_start_loc, key_cache.shape[1],
                                            query.device)
    return paged_attention(query, key_cache, value_cache, metadata, scale, triton_decode=triton_decode)


def gather_keys(cache: torch.Tensor, group: AttentionGroup, slot: int) -> torch.Tensor:
    """The group's keys (slot 0) or values (slot 1) dense: `[num_seqs, kv_heads, num_keys,
    head_dim]` in the query-side layout SDPA takes (a view of the group's gather buffer for that
    slot, valid until the next layer gathers; padding keys past a context hold block 0's)."""
    num_blocks_read, block_size, num_kv_heads, head_dim = group.block_ids.shape[0], *cache.shape[1:]
    wide = as_wide_words(cache)
    buffer = group.gather_buffer(slot, (num_blocks_read, *wide.shape[1:]), wide.dtype, wide.device)
    blocks = torch.index_select(wide, 0, group.block_ids, out=buffer)
    if wide is not cache:
        blocks = blocks.view(cache.dtype)
    keys_per_seq = num_blocks_read // group.num_seqs * block_size
    keys = blocks.view(group.num_seqs, keys_per_seq, num_kv_heads, head_dim)[:, :group.num_keys]
    return keys.transpose(1, 2)


def as_wide_words(cache: torch.Tensor) -> torch.Tensor:
    """`cache` reinterpreted as 8-byte words along its last dim when its layout allows (the same
    bytes, fewer elements for index_select to move one by one), else `cache` itself."""
    ratio = _WIDE_DTYPE.itemsize // cache.element_size()
    if ratio <= 1 or cache.stride(-1) != 1 or cache.shape[-1] % ratio or cache.storage_offset() % ratio \
            or any(stride % ratio for stride in cache.stride()[:-1]):
        return cache
    return cache.view(_WIDE_DTYPE)


def _covers(rows: slice | torch.Tensor, num_tokens: int) -> bool:
    return isinstance(rows, slice) and rows == slice(0, num_tokens)


def _attend(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, group: AttentionGroup,
            scale: float, triton_decode: bool) -> torch.Tensor:
    """The group's output rows `[num_seqs * num_queries, num_heads, head_dim]`."""
    if triton_decode and not group.causal and group.num_queries == 1:
        return paged_decode_triton(query, key_cache, value_cache, group, scale)
    keys = gather_keys(key_cache, group, 0).to(query.dtype)
    values = gather_keys(value_cache, group, 1).to(query.dtype)
    num_seqs, num_queries = group.num_seqs, group.num_queries
    _, num_heads, head_dim = query.shape
    num_kv_heads = keys.shape[1]
    if group.causal:  # square: SDPA's own causal mask, and its GQA (flash attention takes both)
        q = query.reshape(num_seqs, num_queries, num_heads, head_dim).transpose(1, 2)
        attended = F.scaled_dot_product_attention(q, keys, values, is_causal=True, scale=scale,
                                                  enable_gqa=num_heads != num_kv_heads)
        return attended.transpose(1, 2).reshape(-1, num_heads, head_dim)
    # Keys before the first query: a mask. The query heads of one KV head are packed as extra
    # query rows (no GQA inside SDPA: its masked kernels take equal head counts).
    group_size = num_heads // num_kv_heads
    q = query.reshape(num_seqs, num_queries, num_kv_heads, group_size, head_dim)
    q = q.transpose(1, 2).reshape(num_seqs, num_kv_heads, num_queries * group_size, head_dim)
    attended = F.scaled_dot_product_attention(q, keys, values, attn_mask=group.key_mask(group_size), scale=scale)
    attended = attended.view(num_seqs, num_kv_heads, num_queries, group_size, head_dim).transpose(1, 2)
    return attended.reshape(-1, num_heads, head_dim)
