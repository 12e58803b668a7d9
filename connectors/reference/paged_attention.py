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

`paged_kv_cache.write_kv` stores new K and V into their slots; `paged_attention` reads them back. On CUDA with
CuPy, kernels/paged_attention.cu computes the same thing in one launch (tested against this
torch code under the gpu marker); everywhere else this module's torch code runs.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kvtierd.connectors.reference.paged_attention_cuda import paged_attention_cuda, uses_paged_kernel
from kvtierd.connectors.reference.paged_kv_cache import check_cache_pair
from kvtierd.errors import InvalidArgument
from kvtierd.units import ceil_div


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_tables: torch.Tensor, context_lens: torch.Tensor, query_start_loc: torch.Tensor,
                    scale: float | None = None) -> torch.Tensor:
    """Attention output `[num_tokens, num_heads, head_dim]` for varlen `query` (see the module doc).

    Grouped-query attention: query head `h` reads KV head `h // (num_heads // num_kv_heads)`.
    Softmax runs in fp32; the result has the query's dtype.
    """
    check_cache_pair(key_cache, value_cache)
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    if num_heads % num_kv_heads or key_cache.shape[3] != head_dim:
        raise InvalidArgument(f"{num_heads} query heads of {head_dim} cannot read {num_kv_heads} KV heads "
                              f"of {key_cache.shape[3]}")
    num_seqs = context_lens.shape[0]
    if query_start_loc.shape[0] != num_seqs + 1 or int(query_start_loc[-1]) != num_tokens:
        raise InvalidArgument("query_start_loc must hold num_seqs + 1 offsets ending at num_tokens")
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    if uses_paged_kernel(query, key_cache):
        return paged_attention_cuda(query, key_cache, value_cache, block_tables, context_lens, query_start_loc,
                                    scale)
    return paged_attention_reference(query, key_cache, value_cache, block_tables, context_lens, query_start_loc,
                                     scale)


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, context_len: int) -> torch.Tensor:
    """The first `context_len` tokens of one sequence, contiguous: `[context_len, kv_heads, head_dim]`."""
    block_size = cache.shape[1]
    num_blocks = ceil_div(context_len, block_size)
    blocks = cache.index_select(0, block_table[:num_blocks])
    return blocks.reshape(num_blocks * block_size, *cache.shape[2:])[:context_len]


def paged_attention_reference(query, key_cache, value_cache, block_tables, context_lens, query_start_loc,
                              scale: float) -> torch.Tensor:
    """The torch implementation: per sequence, gather its context, then scaled_dot_product_attention
    (whose enable_gqa maps query head h to KV head h // group without copying the KV)."""
    out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    lens = context_lens.tolist()
    for s, context_len in enumerate(lens):
        start, end = starts[s], starts[s + 1]
        num_queries = end - start
        if num_queries == 0:
            continue
        if not num_queries <= context_len:
            raise InvalidArgument(f"sequence {s} has {num_queries} queries but a context of {context_len}")
        table = block_tables[s]
        keys = gather_context(key_cache, table, context_len).float()
        values = gather_context(value_cache, table, context_len).float()
        q = query[start:end].float().transpose(0, 1)  # [heads, queries, dim]
        k, v = keys.transpose(0, 1), values.transpose(0, 1)  # [heads, context, dim]
        if num_queries == 1:  # the last position sees everything
            mask = None
        else:  # query i (position context_len - num_queries + i) sees key j <= that position
            query_positions = torch.arange(context_len - num_queries, context_len, device=query.device).unsqueeze(1)
            mask = torch.arange(context_len, device=query.device).unsqueeze(0) <= query_positions
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        out[start:end] = attended.transpose(0, 1).to(query.dtype)
    return out
