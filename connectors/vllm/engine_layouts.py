"""The daemon layouts of a vLLM engine's KV: what one block of each TP shard holds, and its name.

A one-group attention model keeps the layout of earlier releases (`layout_from_vllm_config`: the
model's layers, KV heads, head size and dtype, named "MODEL@vllm-LAYOUT"); a model served group by
group (kv_groups.py) gets `hybrid_layout`: a slot of `max layers in a group` pages, as K and V of
one float dtype where every group holds plain attention pages, as opaque uint8 pages otherwise
(MLA latents, Mamba state), named "MODEL@vllm-LAYOUT/<groups>". TP shards are layouts of their own
(`tp_rank`), but vLLM's `kv_tp_replicas` consecutive ranks hold identical KV and share one
(RankLayouts).
"""

from __future__ import annotations

from typing import Any

from kvtierd.connectors.vllm.kv_groups import EngineGroups, UnsupportedModel, is_plain_attention
from kvtierd.layout import DTYPES, Layout

_CACHE_DTYPES = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn"}


def layout_from_vllm_config(vllm_config: Any, tp_rank: int, model_id: str | None = None,
                            kv_cache_layout: str | None = None, tp_size: int | None = None) -> Layout:
    """The kvtierd Layout of this rank's KV blocks of a one-group attention model, from vLLM's
    model, cache and parallel config; the engine's KVCacheLayout name joins the model id."""
    model_config, cache_config = vllm_config.model_config, vllm_config.cache_config
    parallel_config = vllm_config.parallel_config
    cache_dtype = getattr(cache_config, "cache_dtype", "auto")
    if cache_dtype == "auto":
        model_dtype = str(model_config.dtype).removeprefix("torch.")  # torch.float16 -> "float16"
        dtype_name = model_dtype if model_dtype in DTYPES else None
    else:
        dtype_name = _CACHE_DTYPES.get(cache_dtype)
    if dtype_name is None:
        raise ValueError(f"the kvtierd connector cannot store a KV cache of dtype {cache_dtype!r} "
                         f"(model dtype {model_config.dtype})")
    name = model_id or str(model_config.model)
    if kv_cache_layout:
        name = f"{name}@vllm-{kv_cache_layout}"
    return Layout(name, model_config.get_num_layers(parallel_config),
                  model_config.get_num_kv_heads(parallel_config), model_config.get_head_size(),
                  cache_config.block_size, dtype_name, tp_rank,
                  parallel_config.tensor_parallel_size if tp_size is None else tp_size)


def hybrid_layout(engine: EngineGroups, kv_cache_config: Any, model_id: str, kv_cache_layout: str | None,
                  tp_rank: int, tp_size: int) -> Layout:
    """The daemon layout of a model served group by group: K/V of one float dtype where every
    group holds plain attention pages, opaque uint8 pages otherwise (MLA, Mamba)."""
    groups = kv_cache_config.kv_cache_groups
    specs = [groups[g.group_id].kv_cache_spec for g in engine.groups]
    name = f"{model_id}@vllm-{kv_cache_layout or 'default'}/{engine.signature()}"
    geometry = {(s.num_kv_heads, s.head_size, str(s.dtype)) for s in specs if is_plain_attention(s)}
    if len(geometry) == 1 and all(is_plain_attention(s) for s in specs):
        ((num_kv_heads, head_size, dtype),) = geometry
        return Layout(name, engine.slot_num_layers, num_kv_heads, head_size, engine.block_size,
                      dtype.removeprefix("torch."), tp_rank, tp_size)
    if engine.page_nbytes % (2 * engine.block_size):
        raise UnsupportedModel(f"a page of {engine.page_nbytes} bytes is not a whole number of bytes per token "
                               f"and K/V half at block size {engine.block_size}")
    return Layout(name, engine.slot_num_layers, 1, engine.page_nbytes // (2 * engine.block_size),
                  engine.block_size, "uint8", tp_rank, tp_size)


def engine_kv_cache_layout(vllm_config: Any, kv_cache_config: Any) -> str | None:
    """The KVCacheLayout vLLM resolved for this engine (`KVCacheConfig.kv_cache_layout`, also
    copied to `cache_config.kv_cache_layout`), e.g. "LBHNC"."""
    layout = getattr(kv_cache_config, "kv_cache_layout", None) or getattr(vllm_config.cache_config,
                                                                           "kv_cache_layout", None)
    return None if layout is None else str(getattr(layout, "name", layout))


class RankLayouts:
    """The daemon layouts of an engine's KV, one per distinct TP shard.

    `kv_tp_replicas` consecutive ranks hold identical KV (vLLM's KVCacheConfig; MLA's latent cache
    under TP): they share one layout, whose shard index is `rank // replicas`, written by the first
    rank of the set. Invariant: `layouts[i]` is shard i's, `len(layouts) == tp_size // replicas`.
    """

    def __init__(self, vllm_config: Any, kv_cache_config: Any, engine: EngineGroups, model_id: str | None) -> None:
        parallel_config = vllm_config.parallel_config
        if getattr(parallel_config, "pipeline_parallel_size", 1) != 1:
            raise ValueError("the kvtierd connector does not support pipeline parallelism")
        tp_size = parallel_config.tensor_parallel_size
        replicas = int(getattr(kv_cache_config, "kv_tp_replicas", 1) or 1)
        if tp_size % replicas:
            raise ValueError(f"kv_tp_replicas {replicas} does not divide tensor_parallel_size {tp_size}")
        self.replicas = replicas
        num_shards = tp_size // replicas
        kv_layout = engine_kv_cache_layout(vllm_config, kv_cache_config)
        name = model_id or str(vllm_config.model_config.model)
        uniform = engine.uniform_attention and layout_from_vllm_config(
            vllm_config, 0, model_id, kv_layout, num_shards).num_layers == engine.slot_num_layers
        if uniform:  # (a model whose layers share caches has fewer pages than layers: served by groups)
            self.layouts = [layout_from_vllm_config(vllm_config, shard, model_id, kv_layout, num_shards)
                            for shard in range(num_shards)]
        else:
            self.layouts = [hybrid_layout(engine, kv_cache_config, name, kv_layout, shard, num_shards)
                            for shard in range(num_shards)]

    def of_rank(self, rank: int) -> Layout:
        return self.layouts[rank // self.replicas]

    def writes(self, rank: int) -> bool:
        """Does this rank store its shard (the first rank of its replica set)?"""
        return rank % self.replicas == 0
