"""The engine's KV pages, group by group, as raw bytes, and the copies between engine blocks and pool slots.

`register_kv_caches` gets, per layer name, vLLM's view of that layer's cache (vllm/v1/worker/utils.py
`allocate_kv_cache`, vllm/v1/kv_cache_interface.py `create_kv_cache_views`): for attention a
`[num_blocks, heads, block_size, 2 × head_size]` view in the model's dtype, for MLA a latent
`[num_blocks, 1, block_size, 576]`, for Mamba an int8 view of the padded state page; a list of views
where a layer keeps several. All are strided views into the engine's allocation. Whatever the
dtype, layout (KVCacheLayout) or padding, layer l's page of block b is `page_size_bytes`
contiguous bytes at `base_l + b × block_stride` (KVCacheTensor's contract): this module moves
exactly those bytes, never their values, so every copy is bit exact and a page's meaning (K then
V per token with FlashAttention, a (block, head)'s K rows then V rows with CPU_ATTN, a GDN state)
is the engine's own. The layout name is part of the key namespace (kv_groups.py), so engines
share pages only with engines of the same layout.

A pool slot is `[slot_num_layers, page_nbytes]` bytes; group g's block fills its first
`len(layers of g)` rows in vLLM's layer order. Layers of one group that alias the same bytes are
vLLM's shared caches: each name still has its row, so every group's block has the same shape.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from kvtierd.connectors.vllm.kv_groups import EngineGroups, ServedGroup, UnsupportedModel


def contiguous_runs(pool_block_ids: Sequence[int]) -> Iterator[tuple[int, int, int]]:
    """(offset in the list, first pool block id, length) of each run of consecutive ids."""
    start = 0
    for index in range(1, len(pool_block_ids) + 1):
        if index == len(pool_block_ids) or pool_block_ids[index] != pool_block_ids[index - 1] + 1:
            yield start, pool_block_ids[start], index - start
            start = index


def _first_view(cache: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor:
    return cache if isinstance(cache, torch.Tensor) else cache[0]


def _placements(kv_cache_config: Any) -> dict[str, int]:
    """Layer name -> block stride in bytes, from vLLM's KVCacheTensors (empty if it has none)."""
    return {name: tensor.block_stride for tensor in getattr(kv_cache_config, "kv_cache_tensors", None) or ()
            for name in tensor.layers}


def _memory_order(page: torch.Tensor) -> torch.Tensor:
    """`page` with its dims permuted outermost-first by stride (the order its elements lie in)."""
    return page.permute(*sorted(range(page.dim()), key=lambda axis: -page.stride(axis)))


def _is_dense(page: torch.Tensor) -> bool:
    """Do the page's elements fill one contiguous span?"""
    return _memory_order(page).is_contiguous()


def _page_view(cache: torch.Tensor | Sequence[torch.Tensor], num_blocks: int, page_nbytes: int,
               block_stride: int | None) -> torch.Tensor:
    """`[num_blocks, *page dims]` uint8 over the layer's pages, block b's page at row b in memory order.

    A page that fills one span (every layout but those with heads outside blocks) is one row of
    `page_nbytes` bytes at `base + b * block_stride`; this also covers kernel blocks smaller than
    the scheduler's, which lie back to back inside its block. A page split across the layer's
    memory (LHBNC, BHLNC) is the view's own block, its dims in memory order, as bytes."""
    view = _first_view(cache)
    if view.dim() > 1 and not _is_dense(view[0]):
        order = sorted(range(1, view.dim()), key=lambda axis: -view.stride(axis))
        if view.shape[0] != num_blocks or view[0].numel() * view.element_size() != page_nbytes or \
                view.stride(order[-1]) != 1:
            raise UnsupportedModel(f"a KV page split across memory as {tuple(view.shape)} with strides "
                                   f"{view.stride()} is not {num_blocks} pages of {page_nbytes} bytes")
        return view.permute(0, *order).view(torch.uint8)
    storage = view.untyped_storage()
    offset = view.data_ptr() - storage.data_ptr()
    stride = block_stride if block_stride is not None else view.stride(0) * view.element_size()
    if stride < page_nbytes or offset + (num_blocks - 1) * stride + page_nbytes > storage.nbytes():
        raise UnsupportedModel(f"a KV page of {page_nbytes} bytes does not fit a block stride of {stride} bytes "
                               f"in the engine's allocation")
    flat = torch.empty(0, dtype=torch.uint8, device=view.device).set_(storage, 0, (storage.nbytes(),), (1,))
    return flat.as_strided((num_blocks, page_nbytes), (stride, 1), offset)


class EnginePages:
    """Byte views of every served group's pages and the copies to and from pool slots.

    Invariant: `pages[g][j]` is `[num_engine_blocks, page_nbytes]` uint8 over layer j of served
    group g (its j-th layer name), on `device`; the views never outlive the engine's caches.
    """

    def __init__(self, kv_caches: Mapping[str, Any], engine: EngineGroups, kv_cache_config: Any,
                 num_engine_blocks: int | None = None) -> None:
        missing = [name for group in engine.groups for name in group.layer_names if name not in kv_caches]
        if missing:
            raise UnsupportedModel(f"vLLM registered no KV cache for layers {missing[:3]}")
        num_blocks = num_engine_blocks or getattr(kv_cache_config, "num_blocks", None) or \
            _first_view(kv_caches[engine.groups[0].layer_names[0]]).shape[0]
        strides = _placements(kv_cache_config)
        self.engine = engine
        self.num_engine_blocks = num_blocks
        self.pages: dict[int, list[torch.Tensor]] = {
            group.group_id: [_page_view(kv_caches[name], num_blocks, engine.page_nbytes, strides.get(name))
                             for name in group.layer_names]
            for group in engine.groups}
        self.device = self.pages[engine.groups[0].group_id][0].device

    def _pool_rows(self, pool: torch.Tensor) -> torch.Tensor:
        """The pool `[num_blocks, ...]` as `[num_blocks, slot_num_layers, page_nbytes]` bytes."""
        rows = pool.view(torch.uint8).view(pool.shape[0], self.engine.slot_num_layers, self.engine.page_nbytes)
        assert rows.data_ptr() == pool.data_ptr()
        return rows

    def to_pool(self, group: ServedGroup, engine_block_ids: Sequence[int], pool: torch.Tensor,
                pool_block_ids: Sequence[int]) -> None:
        """pool[pool_block_ids[i]] = the group's engine block engine_block_ids[i]."""
        rows = self._pool_rows(pool)
        engine_ids = torch.tensor(list(engine_block_ids), dtype=torch.int64, device=self.device)
        for offset, first, length in contiguous_runs(pool_block_ids):
            ids = engine_ids[offset:offset + length]
            for layer, pages in enumerate(self.pages[group.group_id]):
                rows[first:first + length, layer].view(length, *pages.shape[1:]).copy_(pages.index_select(0, ids))

    def from_pool(self, group: ServedGroup, pool: torch.Tensor, pool_block_ids: Sequence[int],
                  engine_block_ids: Sequence[int]) -> None:
        """The group's engine block engine_block_ids[i] = pool[pool_block_ids[i]]."""
        rows = self._pool_rows(pool)
        engine_ids = torch.tensor(list(engine_block_ids), dtype=torch.int64, device=self.device)
        for offset, first, length in contiguous_runs(pool_block_ids):
            ids = engine_ids[offset:offset + length]
            for layer, pages in enumerate(self.pages[group.group_id]):
                pages.index_copy_(0, ids, rows[first:first + length, layer].view(length, *pages.shape[1:])
                                  .to(self.device))
