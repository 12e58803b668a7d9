"""The paged KV cache of one layer as the reference runner sees it, and writing new tokens into it.

A layer's cache is a pair of views of the daemon's block-major pool, `key_cache = pool[:, layer, 0]`
and `value_cache = pool[:, layer, 1]`, each `[num_blocks, block_size, num_kv_heads, head_dim]`
with a block stride (not contiguous). paged_attention.py reads them; `write_kv` fills them.
"""

from __future__ import annotations

import torch

from kvtierd.errors import InvalidArgument


def check_cache_pair(key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise InvalidArgument(f"key and value caches must be [num_blocks, block_size, kv_heads, head_dim] of one "
                              f"shape, got {tuple(key_cache.shape)} and {tuple(value_cache.shape)}")


def write_kv(key_cache: torch.Tensor, value_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             slot_block_ids: torch.Tensor, slot_offsets: torch.Tensor) -> None:
    """Store `key[i]`, `value[i]` (each `[kv_heads, head_dim]`) at block `slot_block_ids[i]`,
    row `slot_offsets[i]`, writing through the (strided) cache views into the pool."""
    check_cache_pair(key_cache, value_cache)
    if key.shape[0] != slot_block_ids.shape[0] or slot_offsets.shape != slot_block_ids.shape:
        raise InvalidArgument(f"{key.shape[0]} tokens but {slot_block_ids.shape[0]} slots")
    if key.shape[0] == 0:
        return
    key_cache[slot_block_ids, slot_offsets] = key.to(key_cache.dtype)
    value_cache[slot_block_ids, slot_offsets] = value.to(value_cache.dtype)
