"""Random paged batches for the attention tests, and the two oracles the SDPA path is held to:
the per-sequence torch implementation the runner used before (gather, upcast to fp32, explicit
mask), and a float64 loop straight from the definition in paged_attention.py."""

from __future__ import annotations

import dataclasses
import itertools
import math

import torch
import torch.nn.functional as F

NUM_LAYERS, LAYER = 3, 1  # the caches are views of layer 1 of a 3-layer block-major pool
# A mixed batch: a whole prefill, a prefill after a cached prefix, a decode, a sequence without
# queries, a one-token context. block_size 16 divides none of the context lengths.
MIXED_CONTEXT_LENS = (37, 50, 29, 16, 1)
MIXED_NUM_QUERIES = (37, 13, 1, 0, 1)


@dataclasses.dataclass
class PagedBatch:
    query: torch.Tensor
    pool: torch.Tensor  # [num_blocks, NUM_LAYERS, 2, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor  # unread entries are -1
    context_lens: torch.Tensor
    query_start_loc: torch.Tensor
    scale: float

    @property
    def key_cache(self) -> torch.Tensor:
        return self.pool[:, LAYER, 0]

    @property
    def value_cache(self) -> torch.Tensor:
        return self.pool[:, LAYER, 1]

    def args(self) -> tuple:
        """The arguments of paged_attention_varlen."""
        return (self.query, self.key_cache, self.value_cache, self.block_tables, self.context_lens,
                self.query_start_loc, self.scale)

    def to(self, device) -> PagedBatch:
        return PagedBatch(self.query.to(device), self.pool.to(device), self.block_tables.to(device),
                          self.context_lens.to(device), self.query_start_loc.to(device), self.scale)


def make_batch(context_lens=MIXED_CONTEXT_LENS, num_queries=MIXED_NUM_QUERIES, *, num_heads=8,
               num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32, seed=0,
               num_spare_blocks=3) -> PagedBatch:
    """A random batch on the CPU whose sequences own shuffled, non-consecutive blocks of a pool.

    The pool is random everywhere (spare blocks and the other layer's K/V included), so reading a
    wrong block, row, head or layer changes the result. Queries are scaled by 2 for peaked softmaxes.
    """
    generator = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-length // block_size) for length in context_lens]
    num_blocks = sum(blocks_per_seq) + num_spare_blocks
    pool = torch.randn(num_blocks, NUM_LAYERS, 2, block_size, num_kv_heads, head_dim,
                       generator=generator).to(dtype)
    block_ids = torch.randperm(num_blocks, generator=generator)
    block_tables = torch.full((len(context_lens), max(blocks_per_seq) + 1), -1, dtype=torch.int32)
    taken = 0
    for seq, count in enumerate(blocks_per_seq):
        block_tables[seq, :count] = block_ids[taken:taken + count].to(torch.int32)
        taken += count
    query_start_loc = torch.tensor([0, *itertools.accumulate(num_queries)], dtype=torch.int32)
    query = (2 * torch.randn(int(query_start_loc[-1]), num_heads, head_dim, generator=generator)).to(dtype)
    return PagedBatch(query, pool, block_tables, torch.tensor(context_lens, dtype=torch.int32),
                      query_start_loc, 1.0 / math.sqrt(head_dim))


def per_sequence_reference(batch: PagedBatch) -> torch.Tensor:
    """The runner's attention before SDPA over groups, on the CPU: per sequence, gather its context,
    upcast to fp32, SDPA with an explicit causal mask; the result in the query's dtype."""
    batch = batch.to("cpu")
    query, key_cache, value_cache = batch.query, batch.key_cache, batch.value_cache
    block_size = key_cache.shape[1]
    out = torch.empty_like(query)
    starts = batch.query_start_loc.tolist()
    for seq, context_len in enumerate(batch.context_lens.tolist()):
        start, end = starts[seq], starts[seq + 1]
        num_queries = end - start
        if num_queries == 0:
            continue
        table = batch.block_tables[seq, :-(-context_len // block_size)].long()

        def context(cache: torch.Tensor) -> torch.Tensor:  # [kv_heads, context_len, head_dim], fp32
            blocks = cache.index_select(0, table)
            return blocks.reshape(-1, *cache.shape[2:])[:context_len].float().transpose(0, 1)

        query_positions = torch.arange(context_len - num_queries, context_len).unsqueeze(1)
        mask = torch.arange(context_len).unsqueeze(0) <= query_positions
        attended = F.scaled_dot_product_attention(query[start:end].float().transpose(0, 1), context(key_cache),
                                                  context(value_cache), attn_mask=mask, scale=batch.scale,
                                                  enable_gqa=True)
        out[start:end] = attended.transpose(0, 1).to(query.dtype)
    return out


def naive_attention(batch: PagedBatch) -> torch.Tensor:
    """Float64, one (token, head) at a time, straight from the definition in paged_attention.py."""
    batch = batch.to("cpu")
    num_tokens, num_heads, head_dim = batch.query.shape
    group = num_heads // batch.key_cache.shape[2]
    block_size = batch.key_cache.shape[1]
    out = torch.zeros(num_tokens, num_heads, head_dim, dtype=torch.float64)
    starts = batch.query_start_loc.tolist()
    for seq, context_len in enumerate(batch.context_lens.tolist()):
        num_queries = starts[seq + 1] - starts[seq]
        for i in range(num_queries):
            position = context_len - num_queries + i
            slots = [(int(batch.block_tables[seq, key // block_size]), key % block_size)
                     for key in range(position + 1)]
            for head in range(num_heads):
                keys = torch.stack([batch.key_cache[b, r, head // group] for b, r in slots]).double()
                values = torch.stack([batch.value_cache[b, r, head // group] for b, r in slots]).double()
                weights = torch.softmax(keys @ batch.query[starts[seq] + i, head].double() * batch.scale, 0)
                out[starts[seq] + i, head] = weights @ values
    return out
