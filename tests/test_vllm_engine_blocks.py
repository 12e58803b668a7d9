"""Engine block views and copies of the vLLM connector, without a daemon."""

from __future__ import annotations

import pytest
import torch

from kvtierd.connectors.vllm_engine_blocks import (
    CrossLayerBlocks, PerLayerBlocks, contiguous_runs, cross_layer_block_view, layers_in_order)
from kvtierd.layout import Layout

LAYOUT = Layout("blocks-test", 3, 2, 4, 4, "bfloat16")
NUM_ENGINE_BLOCKS = 10


def random_physical(order):
    logical = (LAYOUT.num_layers, 2, NUM_ENGINE_BLOCKS, LAYOUT.block_size, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    return torch.randn(tuple(logical[i] for i in order)).to(torch.bfloat16)


def test_contiguous_runs_split_where_ids_jump():
    assert list(contiguous_runs([3, 4, 5, 9, 10, 2])) == [(0, 3, 3), (3, 9, 2), (5, 2, 1)]
    assert list(contiguous_runs([])) == []


def test_layers_are_ordered_by_their_index_not_their_name():
    caches = {f"model.layers.{i}.self_attn.attn": torch.full((1,), float(i)) for i in (10, 2, 0)}
    assert [int(t.item()) for t in layers_in_order(caches)] == [0, 2, 10]
    with pytest.raises(ValueError, match="share a layer index"):
        layers_in_order({"a.1": torch.zeros(1), "b.1": torch.zeros(1)})


def test_the_nhd_cross_layer_cache_is_already_block_major():
    physical = random_physical((2, 0, 1, 3, 4, 5))
    view = cross_layer_block_view(physical, (2, 0, 1, 3, 4, 5))
    assert view.is_contiguous() and view.data_ptr() == physical.data_ptr()
    assert torch.equal(view, physical)


def test_the_hnd_cross_layer_view_reads_heads_from_their_physical_place():
    physical = random_physical((2, 4, 0, 1, 3, 5))  # [blocks, heads, layers, 2, tokens, dim]
    view = cross_layer_block_view(physical, (2, 4, 0, 1, 3, 5))
    assert tuple(view.shape) == (NUM_ENGINE_BLOCKS, *LAYOUT.block_shape) and not view.is_contiguous()
    assert torch.equal(view[7, 2, 1, 3, 1], physical[7, 1, 2, 1, 3])


@pytest.mark.parametrize("kind", ["per_layer", "cross_nhd", "cross_hnd"])
def test_engine_blocks_round_trip_through_scattered_pool_slots(kind):
    """to_pool then from_pool into other engine blocks copies every block exactly, pool slots
    hold the block-major bytes, and untouched engine blocks stay untouched."""
    if kind == "per_layer":
        caches = [torch.randn(2, NUM_ENGINE_BLOCKS, 4, 2, 4).to(torch.bfloat16) for _ in range(3)]
        engine = PerLayerBlocks(caches, LAYOUT)
        block = lambda e: torch.stack([c[:, e] for c in caches])  # noqa: E731
    else:
        order = (2, 0, 1, 3, 4, 5) if kind == "cross_nhd" else (2, 4, 0, 1, 3, 5)
        view = cross_layer_block_view(random_physical(order), order)
        engine = CrossLayerBlocks(view, LAYOUT)
        block = lambda e: view[e]  # noqa: E731
    pool = torch.zeros(12, *LAYOUT.block_shape, dtype=torch.bfloat16)
    engine.to_pool([1, 2, 3, 6], pool, [8, 9, 0, 5])
    for engine_id, pool_id in zip([1, 2, 3, 6], [8, 9, 0, 5]):
        assert torch.equal(pool[pool_id], block(engine_id))
    untouched = block(0).clone()
    engine.from_pool(pool, [8, 9, 0, 5], [4, 5, 7, 9])
    for source, target in zip([1, 2, 3, 6], [4, 5, 7, 9]):
        assert torch.equal(block(target), block(source))
    assert torch.equal(block(0), untouched)


def test_caches_of_another_geometry_are_refused_with_the_layout_named():
    caches = [torch.zeros(2, NUM_ENGINE_BLOCKS, 4, 2, 4, dtype=torch.float16) for _ in range(3)]
    with pytest.raises(ValueError, match="blocks-test"):
        PerLayerBlocks(caches, LAYOUT)  # float16 caches, a bfloat16 layout
    with pytest.raises(ValueError, match="contiguous"):
        PerLayerBlocks([c.to(torch.bfloat16).transpose(3, 4).contiguous().transpose(3, 4) for c in caches], LAYOUT)
