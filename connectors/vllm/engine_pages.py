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

A load or store of a group's blocks is one gather-and-scatter of cells (page_cells.py,
cell_moves.py): a fixed number of tensor ops and copies per call, whatever the ids (a pool after
churn hands out one run per block) and however many layers share the engine's allocation.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch

from kvtierd.connectors.vllm.cell_moves import HostStaging, move_cells
from kvtierd.connectors.vllm.kv_groups import EngineGroups, ServedGroup, UnsupportedModel
from kvtierd.connectors.vllm.page_cells import PageCells, group_cells


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


def _checked_ids(block_ids: Sequence[int], limit: int, what: str) -> torch.Tensor:
    """`block_ids` as a 1-D int64 CPU tensor, each in [0, limit), or ValueError."""
    ids = torch.as_tensor(block_ids, dtype=torch.int64).cpu()
    if ids.dim() != 1:
        raise ValueError(f"{what} must be a list of ids, got shape {tuple(ids.shape)}")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= limit):
        raise ValueError(f"{what} must be in [0, {limit}), got {int(ids.min())}..{int(ids.max())}")
    return ids


class EnginePagesLike(Protocol):
    """The engine's KV pages as the worker moves them: the interface EnginePages implements (tests pass fakes)."""

    device: torch.device

    def to_pool(self, group: ServedGroup, engine_block_ids: Sequence[int], pool: torch.Tensor,
                pool_block_ids: Sequence[int]) -> None: ...

    def from_pool(self, group: ServedGroup, pool: torch.Tensor, pool_block_ids: Sequence[int],
                  engine_block_ids: Sequence[int]) -> None: ...


class EnginePages:
    """Byte views of every served group's pages and the copies to and from pool slots.

    Invariants: `pages[g][j]` is `[num_engine_blocks, *page dims]` uint8 over layer j of served
    group g (its j-th layer name), the page dims in memory order, on `device`; `cells[g]` places
    the same pages as cells of the allocations they live in (page_cells.py); neither outlives the
    engine's caches. A copy checks every id before it writes a byte.
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
        self.cells: dict[int, list[PageCells]] = {
            group_id: group_cells(pages, num_blocks) for group_id, pages in self.pages.items()}
        self.device = self.pages[engine.groups[0].group_id][0].device
        self._staging = HostStaging(pinned=self.device.type == "cuda")

    def _pool_bytes(self, pool: torch.Tensor) -> torch.Tensor:
        """The pool `[num_blocks, ...]` as 1-D bytes, after checking it is slots of `slot_num_layers` pages."""
        slot_nbytes = self.engine.slot_num_layers * self.engine.page_nbytes
        if pool.dim() == 0 or not pool.is_contiguous() or pool.numel() * pool.element_size() != \
                pool.shape[0] * slot_nbytes:
            raise ValueError(f"a pool of {tuple(pool.shape)} {pool.dtype} is not contiguous slots of {slot_nbytes} "
                             f"bytes ({self.engine.slot_num_layers} pages of {self.engine.page_nbytes})")
        return pool.view(-1).view(torch.uint8)

    def to_pool(self, group: ServedGroup, engine_block_ids: Sequence[int], pool: torch.Tensor,
                pool_block_ids: Sequence[int]) -> None:
        """pool[pool_block_ids[i]] = the group's engine block engine_block_ids[i]."""
        self._copy(group, engine_block_ids, pool, pool_block_ids, to_pool=True)

    def from_pool(self, group: ServedGroup, pool: torch.Tensor, pool_block_ids: Sequence[int],
                  engine_block_ids: Sequence[int]) -> None:
        """The group's engine block engine_block_ids[i] = pool[pool_block_ids[i]]."""
        self._copy(group, engine_block_ids, pool, pool_block_ids, to_pool=False)

    def _copy(self, group: ServedGroup, engine_block_ids: Sequence[int], pool: torch.Tensor,
              pool_block_ids: Sequence[int], *, to_pool: bool) -> None:
        """One move of cells per allocation the group's layers live in (one in vLLM 0.32)."""
        engine_ids = _checked_ids(engine_block_ids, self.num_engine_blocks, "engine block ids")
        pool_ids = _checked_ids(pool_block_ids, pool.shape[0] if pool.dim() else 0, "pool block ids")
        if engine_ids.numel() != pool_ids.numel():
            raise ValueError(f"{engine_ids.numel()} engine blocks for {pool_ids.numel()} pool blocks")
        pool_bytes = self._pool_bytes(pool)
        if not engine_ids.numel():
            return
        for cells in self.cells[group.group_id]:
            engine_cells = cells.engine_cells(engine_ids)
            pool_cells = cells.pool_cells(pool_ids, self.engine.slot_num_layers)
            if to_pool:
                move_cells(pool_bytes, pool_cells, cells.storage, engine_cells, cells.cell_nbytes, self._staging)
            else:
                move_cells(cells.storage, engine_cells, pool_bytes, pool_cells, cells.cell_nbytes, self._staging)
