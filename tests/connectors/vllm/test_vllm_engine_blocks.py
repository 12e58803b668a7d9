"""Engine block views and copies of the vLLM connector, without a daemon: the per-layer caches
are built as vLLM 0.32 builds them (tests/connectors/vllm/vllm_fakes.py `vllm_kv_caches`), for every KVCacheLayout."""

from __future__ import annotations

import pytest
import torch

from kvtierd.connectors.vllm.engine_blocks import PagedLayers, contiguous_runs, layers_in_order, physical_pages
from kvtierd.layout import Layout
from tests.connectors.vllm.vllm_fakes import KV_CACHE_LAYOUTS, vllm_kv_caches

LAYOUT = Layout("blocks-test", 3, 2, 4, 4, "bfloat16")
NUM_ENGINE_BLOCKS = 10


def engine_caches(layout_name: str) -> list[torch.Tensor]:
    caches = vllm_kv_caches(layout_name, LAYOUT.num_layers, NUM_ENGINE_BLOCKS, LAYOUT.num_kv_heads,
                            LAYOUT.block_size, LAYOUT.head_dim, torch.bfloat16)
    for cache in caches.values():
        cache.copy_(torch.randn(cache.shape).to(torch.bfloat16))
    return layers_in_order(caches)


def test_contiguous_runs_split_where_ids_jump():
    assert list(contiguous_runs([3, 4, 5, 9, 10, 2])) == [(0, 3, 3), (3, 9, 2), (5, 2, 1)]
    assert list(contiguous_runs([])) == []


def test_layers_are_ordered_by_their_index_not_their_name_and_shared_caches_count_once():
    caches = {f"model.layers.{i}.self_attn.attn": torch.full((1,), float(i)) for i in (10, 2, 0)}
    assert [int(t.item()) for t in layers_in_order(caches)] == [0, 2, 10]
    with pytest.raises(ValueError, match="share a layer index"):
        layers_in_order({"a.1": torch.zeros(1), "b.1": torch.zeros(1)})
    shared = torch.zeros(4)
    assert len(layers_in_order({"model.layers.0.attn": shared, "model.layers.1.attn": shared})) == 1


def test_a_page_is_moved_in_its_physical_order():
    """LBHNC pages are contiguous as they are; LBNHC's are contiguous once heads and tokens swap."""
    lbhnc, lbnhc = engine_caches("LBHNC")[0], engine_caches("LBNHC")[0]
    assert physical_pages(lbhnc).shape == lbhnc.shape and physical_pages(lbhnc)[3].is_contiguous()
    pages = physical_pages(lbnhc)
    assert tuple(pages.shape[1:]) == (LAYOUT.block_size, LAYOUT.num_kv_heads, 2 * LAYOUT.head_dim)
    assert pages[3].is_contiguous() and not lbnhc[3].is_contiguous()
    assert torch.equal(pages[3, 1, 0], lbnhc[3, 0, 1])


@pytest.mark.parametrize("layout_name", sorted(KV_CACHE_LAYOUTS))
def test_engine_blocks_round_trip_through_scattered_pool_slots(layout_name):
    """to_pool then from_pool into other engine blocks copies every block exactly, and untouched
    engine blocks stay untouched, whatever the layout's strides."""
    caches = engine_caches(layout_name)
    engine = PagedLayers(caches, LAYOUT)
    block = lambda e: torch.stack([c[e] for c in caches]).clone()  # noqa: E731
    pool = torch.zeros(12, *LAYOUT.block_shape, dtype=torch.bfloat16)
    sources, slots, targets = [1, 2, 3, 6], [8, 9, 0, 5], [4, 5, 7, 9]
    expected = [block(e) for e in sources]
    untouched = block(0)
    engine.to_pool(sources, pool, slots)
    engine.from_pool(pool, slots, targets)
    for value, target in zip(expected, targets):
        assert torch.equal(block(target), value)
    assert torch.equal(block(0), untouched)


def test_a_pool_slot_holds_each_layers_page_bytes_in_memory_order():
    """LBHNC (CPU_ATTN): slot layer l is exactly the engine page's bytes: [heads, tokens, K|V]."""
    caches = engine_caches("LBHNC")
    pool = torch.zeros(4, *LAYOUT.block_shape, dtype=torch.bfloat16)
    PagedLayers(caches, LAYOUT).to_pool([7], pool, [2])
    for layer, cache in enumerate(caches):
        assert torch.equal(pool[2, layer].flatten(), cache[7].flatten())


def test_caches_of_another_geometry_are_refused_with_the_layout_named():
    caches = engine_caches("LBHNC")
    with pytest.raises(ValueError, match="blocks-test"):
        PagedLayers(caches[:2], LAYOUT)  # a layer short
    with pytest.raises(ValueError, match="blocks-test"):
        PagedLayers([c[:, :, :, :4] for c in caches], LAYOUT)  # not K and V of head_dim
    with pytest.raises(ValueError, match="float16"):
        PagedLayers([c.to(torch.float16) for c in caches], LAYOUT)
