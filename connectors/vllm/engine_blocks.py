"""The engine's KV blocks as vLLM 0.32 hands them to a connector, and the copies to and from the pool.

`register_kv_caches` gets one tensor per layer (vllm/v1/worker/utils.py, `allocate_kv_cache`,
and vllm/v1/kv_cache_interface.py, `create_kv_cache_views`): a logical
`[num_blocks, num_kv_heads, block_size, head_size + head_size_v]` view in the model's dtype,
all layers strided views into one shared allocation. Where a block's bytes lie is set by the
engine's `KVCacheLayout` (vllm/v1/kv_cache_layout.py: a permutation of [layer, block, head,
token, content]; CPU_ATTN reads only LBHNC, FlashAttention defaults to LBNHC). What the
content dimension means is the backend's (FlashAttention: K then V per token; CPU_ATTN: a
(block, head)'s N K-rows then its N V-rows), so a page is moved as opaque values, in its
physical order, and the layout name is part of the key namespace (connector.py): engines
share blocks only with engines of the same layout.

`PagedLayers` moves block b of every layer into one pool slot: layer l's page goes to
`pool[slot, l]` (the same number of values, `2 × block_size × heads × dim`), in the page's
physical order (the view's trailing dims permuted by descending stride). Any layout whose
trailing dims are a permutation is served: strided pages are copied element by element by
torch. Every copy moves raw values of one dtype (no conversion), so it is bit exact.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence

import torch

from kvtierd.layout import Layout

_LAYER_INDEX = re.compile(r"\d+")


def contiguous_runs(pool_block_ids: Sequence[int]) -> Iterator[tuple[int, int, int]]:
    """(offset in the list, first pool block id, length) of each run of consecutive ids."""
    start = 0
    for index in range(1, len(pool_block_ids) + 1):
        if index == len(pool_block_ids) or pool_block_ids[index] != pool_block_ids[index - 1] + 1:
            yield start, pool_block_ids[start], index - start
            start = index


def layers_in_order(kv_caches: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
    """The per-layer caches ordered by the layer index in their names ("model.layers.7.self_attn
    .attn" is layer 7): the order of the layers in a pool slot. Layers that share one cache
    (vLLM registers a shared cache under each name) count once."""
    def layer_index(name: str) -> int:
        numbers = _LAYER_INDEX.findall(name)
        if not numbers:
            raise ValueError(f"cannot tell the layer index of KV cache {name!r}")
        return int(numbers[-1])
    names = sorted(kv_caches, key=layer_index)
    indices = [layer_index(name) for name in names]
    if len(set(indices)) != len(indices):
        raise ValueError(f"two KV caches share a layer index: {names}")
    caches, seen = [], set()
    for name in names:
        cache = kv_caches[name]
        key = (cache.data_ptr(), tuple(cache.shape), tuple(cache.stride()))
        if key not in seen:
            seen.add(key)
            caches.append(cache)
    return caches


def physical_pages(layer_cache: torch.Tensor) -> torch.Tensor:
    """`[num_blocks, ...]` with the page dims in memory order (outermost first)."""
    trailing = sorted(range(1, layer_cache.dim()), key=lambda axis: -layer_cache.stride(axis))
    return layer_cache.permute(0, *trailing)


class PagedLayers:
    """Engine caches, one `[num_engine_blocks, heads, block_size, 2 × head_dim]` view per layer
    in layer order (vLLM 0.32's per-layer views), moved to and from pool slots page by page."""

    def __init__(self, layer_caches: Sequence[torch.Tensor], layout: Layout) -> None:
        caches = list(layer_caches)
        expected = (layout.num_kv_heads, layout.block_size, 2 * layout.head_dim)
        shapes = [tuple(cache.shape) for cache in caches]
        if len(caches) != layout.num_layers or any(cache.dim() != 4 or tuple(cache.shape[1:]) != expected
                                                   for cache in caches):
            raise ValueError(
                f"the engine's KV caches are {len(caches)} layers of {shapes[:1]}, but the kvtierd layout "
                f"{layout.model_id!r} needs {layout.num_layers} layers of "
                f"[num_blocks, {', '.join(map(str, expected))}] "
                "(kv heads, block size, K and V of head_dim): models with MLA, hybrid or per-layer-different "
                "caches, or kernel blocks smaller than the scheduler's block, are not supported")
        if any(cache.dtype != layout.torch_dtype for cache in caches):
            raise ValueError(f"the engine's KV caches are {caches[0].dtype}, the kvtierd layout is "
                             f"{layout.torch_dtype}")
        if len({cache.shape[0] for cache in caches}) != 1 or len({cache.device for cache in caches}) != 1:
            raise ValueError("the engine's per-layer KV caches differ in block count or device")
        self.pages = [physical_pages(cache) for cache in caches]
        self.page_shape = tuple(self.pages[0].shape[1:])
        self.device = caches[0].device
        self.num_engine_blocks = caches[0].shape[0]

    def _pool_pages(self, pool: torch.Tensor, first: int, length: int, layer: int) -> torch.Tensor:
        return pool[first:first + length, layer].reshape(length, *self.page_shape)

    def to_pool(self, engine_block_ids: Sequence[int], pool: torch.Tensor, pool_block_ids: Sequence[int]) -> None:
        """pool[pool_block_ids[i]] = engine block engine_block_ids[i], all layers."""
        engine_ids = torch.tensor(list(engine_block_ids), dtype=torch.int64, device=self.device)
        for offset, first, length in contiguous_runs(pool_block_ids):
            ids = engine_ids[offset:offset + length]
            for layer, pages in enumerate(self.pages):
                self._pool_pages(pool, first, length, layer).copy_(pages.index_select(0, ids))

    def from_pool(self, pool: torch.Tensor, pool_block_ids: Sequence[int], engine_block_ids: Sequence[int]) -> None:
        """engine block engine_block_ids[i] = pool[pool_block_ids[i]], all layers."""
        engine_ids = torch.tensor(list(engine_block_ids), dtype=torch.int64, device=self.device)
        for offset, first, length in contiguous_runs(pool_block_ids):
            ids = engine_ids[offset:offset + length]
            for layer, pages in enumerate(self.pages):
                pages.index_copy_(0, ids, self._pool_pages(pool, first, length, layer).to(self.device))
