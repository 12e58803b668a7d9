"""The engine's KV blocks as the vLLM connector sees them, and the copies to and from the pool.

vLLM hands a KV connector its caches in one of two ways (vllm/distributed/kv_transfer/
kv_connector/v1/base.py):
- `register_kv_caches(dict layer name → tensor)`: one tensor per layer. With FlashAttention
  (vllm/v1/attention/backends/flash_attn.py, `get_kv_cache_shape`) a layer is
  `[2, num_blocks, block_size, num_kv_heads, head_size]`; `PerLayerBlocks` moves blocks with
  kvtierd.layout_kernels `gather_blocks` / `scatter_blocks` (one CUDA kernel per batch).
- `register_cross_layers_kv_cache(tensor, attn_backend)`, offered when the connector's
  `prefer_cross_layer_blocks` is true and every layer has one spec: one allocation whose
  physical order is the backend's `get_kv_cache_stride_order(include_num_layers_dimension=True)`
  applied to `(num_layers, *get_kv_cache_shape(...))` (vllm/v1/worker/
  kv_connector_model_runner_mixin.py, `allocate_uniform_kv_caches`; the order's meaning is
  documented on `AttentionBackend.get_kv_cache_stride_order`, vllm/v1/attention/backend.py).
  For FlashAttention with the NHD layout that is `[num_blocks, num_layers, 2, block_size,
  heads, dim]`, byte for byte kvtierd's block-major slot (ARCHITECTURE §3), so `CrossLayerBlocks`
  moves each block as one contiguous span. Other orders (HND) are still correct: the view is
  strided and torch copies element by element.

Every copy moves raw values of one dtype (no conversion), so it is bit exact.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence

import torch

from kvtierd.layout import Layout
from kvtierd.layout_kernels import gather_blocks, scatter_blocks

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
    .attn" is layer 7): the order of the layers in a block-major slot."""
    def layer_index(name: str) -> int:
        numbers = _LAYER_INDEX.findall(name)
        if not numbers:
            raise ValueError(f"cannot tell the layer index of KV cache {name!r}")
        return int(numbers[-1])
    names = sorted(kv_caches, key=layer_index)
    indices = [layer_index(name) for name in names]
    if len(set(indices)) != len(indices):
        raise ValueError(f"two KV caches share a layer index: {names}")
    return [kv_caches[name] for name in names]


def _check_geometry(layout: Layout, block_shape: tuple[int, ...], dtype: torch.dtype, what: str) -> None:
    if tuple(block_shape) != layout.block_shape or dtype != layout.torch_dtype:
        raise ValueError(
            f"{what}: a block is {tuple(block_shape)} {dtype}, but the kvtierd layout {layout.model_id!r} "
            f"is {layout.block_shape} {layout.torch_dtype} (layers, 2, block_size, kv_heads, head_dim). "
            "Models with MLA, hybrid or per-layer-different caches, or kernel blocks smaller than the "
            "scheduler's block, are not supported.")


class PerLayerBlocks:
    """Engine caches, one `[2, num_engine_blocks, block_size, heads, dim]` tensor per layer, in
    layer order. Blocks move through the gather/scatter kernels; a pool on another device
    (a host shm pool beside CUDA caches) is staged through a temporary on the engine's device."""

    def __init__(self, layer_caches: Sequence[torch.Tensor], layout: Layout) -> None:
        caches = list(layer_caches)
        if not caches or any(cache.dim() != 5 or cache.shape[0] != 2 for cache in caches):
            raise ValueError("per-layer KV caches must be [2, num_blocks, block_size, heads, dim] (FlashAttention, "
                             f"FlashInfer), got {[tuple(c.shape) for c in caches][:2]}")
        if not all(cache.is_contiguous() for cache in caches):
            raise ValueError("per-layer KV caches must be contiguous in [2, num_blocks, ...] order (the NHD "
                             "layout); other orders are served by the cross-layer layout")
        _check_geometry(layout, (len(caches), *caches[0].shape[:1], *caches[0].shape[2:]), caches[0].dtype,
                        "per-layer KV caches")
        self.layer_caches = caches
        self.device = caches[0].device
        self.num_engine_blocks = caches[0].shape[1]

    def to_pool(self, engine_block_ids: Sequence[int], pool: torch.Tensor, pool_block_ids: Sequence[int]) -> None:
        """pool[pool_block_ids[i]] = engine block engine_block_ids[i], all layers."""
        for offset, first, length in contiguous_runs(pool_block_ids):
            ids = engine_block_ids[offset:offset + length]
            target = pool[first:first + length]
            if target.device == self.device:
                gather_blocks(self.layer_caches, ids, out=target)
            else:
                target.copy_(gather_blocks(self.layer_caches, ids))

    def from_pool(self, pool: torch.Tensor, pool_block_ids: Sequence[int], engine_block_ids: Sequence[int]) -> None:
        """engine block engine_block_ids[i] = pool[pool_block_ids[i]], all layers."""
        for offset, first, length in contiguous_runs(pool_block_ids):
            source = pool[first:first + length].to(self.device)
            scatter_blocks(source, self.layer_caches, engine_block_ids[offset:offset + length])


def cross_layer_block_view(kv_cache: torch.Tensor, stride_order: Sequence[int] | None,
                           blocks_first_in_layer: bool = False) -> torch.Tensor:
    """`[num_blocks, num_layers, 2, block_size, heads, dim]` view of vLLM's cross-layer cache.

    `kv_cache` is in physical order: the logical shape `(num_layers, *per-layer shape)`
    permuted by `stride_order` (None: identity). The per-layer shape is `[2, num_blocks, ...]`
    (FlashAttention, FlashInfer) or, with `blocks_first_in_layer`, `[num_blocks, 2, ...]`.
    """
    if kv_cache.dim() != 6:
        raise ValueError(f"a cross-layer KV cache must have 6 dims, got {tuple(kv_cache.shape)}")
    order = list(range(6)) if stride_order is None else list(stride_order)
    if sorted(order) != list(range(6)):
        raise ValueError(f"stride order {stride_order} is not a permutation of 0..5")
    logical = kv_cache.permute(*[order.index(axis) for axis in range(6)])  # (layers, *per-layer)
    kv_axis, block_axis = (2, 1) if blocks_first_in_layer else (1, 2)
    return logical.permute(block_axis, 0, kv_axis, 3, 4, 5)


class CrossLayerBlocks:
    """Engine caches as one `[num_engine_blocks, num_layers, 2, block_size, heads, dim]` view,
    possibly strided. When contiguous, an engine block is one span of `bytes_per_block`."""

    def __init__(self, block_view: torch.Tensor, layout: Layout) -> None:
        if block_view.dim() != 6:
            raise ValueError(f"a cross-layer block view must have 6 dims, got {tuple(block_view.shape)}")
        _check_geometry(layout, tuple(block_view.shape[1:]), block_view.dtype, "cross-layer KV cache")
        self.block_view = block_view
        self.device = block_view.device
        self.num_engine_blocks = block_view.shape[0]
        self.is_contiguous = block_view.is_contiguous()

    def to_pool(self, engine_block_ids: Sequence[int], pool: torch.Tensor, pool_block_ids: Sequence[int]) -> None:
        engine_ids = torch.tensor(list(engine_block_ids), dtype=torch.int64, device=self.device)
        for offset, first, length in contiguous_runs(pool_block_ids):
            pool[first:first + length].copy_(self.block_view.index_select(0, engine_ids[offset:offset + length]))

    def from_pool(self, pool: torch.Tensor, pool_block_ids: Sequence[int], engine_block_ids: Sequence[int]) -> None:
        engine_ids = torch.tensor(list(engine_block_ids), dtype=torch.int64, device=self.device)
        for offset, first, length in contiguous_runs(pool_block_ids):
            self.block_view.index_copy_(0, engine_ids[offset:offset + length],
                                        pool[first:first + length].to(self.device))
