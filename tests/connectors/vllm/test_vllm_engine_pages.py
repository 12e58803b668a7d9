"""The engine's KV pages as the vLLM connector moves them, without a daemon: views built as vLLM 0.32
builds them (tests/connectors/vllm/vllm_fakes.py `vllm_kv_caches`, for every KVCacheLayout), and the
shapes the probe of real engines showed for hybrid models: groups whose layers alias one allocation
(Gemma-3, gpt-oss), Mamba state pages as int8 views (Qwen3-Next), MLA latents (DeepSeek-V2)."""

from __future__ import annotations

import pytest
import torch

from kvtierd.connectors.vllm.engine_pages import EnginePages, contiguous_runs
from kvtierd.connectors.vllm.kv_groups import UnsupportedModel, engine_groups
from tests.connectors.vllm import vllm_fakes
from tests.connectors.vllm.vllm_fakes import KV_CACHE_LAYOUTS, vllm_kv_caches

NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_ENGINE_BLOCKS = 3, 2, 4, 4, 10


def uniform(layout_name: str):
    """A one-group model's (config, caches), the caches filled with random bf16 bits."""
    caches = vllm_kv_caches(layout_name, NUM_LAYERS, NUM_ENGINE_BLOCKS, NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM,
                            torch.bfloat16)
    for index, cache in enumerate(caches.values()):
        cache.copy_(torch.randn(cache.shape, generator=torch.Generator().manual_seed(index)).to(torch.bfloat16))
    spec = vllm_fakes.FullAttentionSpec(BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, torch.bfloat16)
    config = vllm_fakes.KVCacheConfig(layout_name, [vllm_fakes.KVCacheGroupSpec(list(caches), spec)])
    return config, caches


def page_bytes(cache: torch.Tensor, block_id: int) -> bytes:
    """A layer's page of one block, in memory order, independent of the module under test."""
    block = cache[block_id]
    order = sorted(range(block.dim()), key=lambda axis: -block.stride(axis))
    return block.permute(*order).contiguous().view(torch.uint8).numpy().tobytes()


def test_contiguous_runs_split_where_ids_jump():
    assert list(contiguous_runs([3, 4, 5, 9, 10, 2])) == [(0, 3, 3), (3, 9, 2), (5, 2, 1)]
    assert list(contiguous_runs([])) == []


@pytest.mark.parametrize("layout_name", sorted(KV_CACHE_LAYOUTS))
def test_pages_round_trip_through_scattered_pool_slots_bit_exact(layout_name):
    """to_pool then from_pool into other engine blocks copies every layer's page exactly, whatever
    the layout's strides, and engine blocks not named stay as they were."""
    config, caches = uniform(layout_name)
    groups = engine_groups(config, prefix_caching=False)
    pages = EnginePages(caches, groups, config)
    (group,) = groups.groups
    pool = torch.zeros(12, NUM_LAYERS, 2 * BLOCK_SIZE * NUM_KV_HEADS * HEAD_DIM, dtype=torch.bfloat16)
    sources, slots, targets = [1, 2, 3, 6], [8, 9, 0, 5], [4, 5, 7, 9]
    expected = [[page_bytes(c, e) for c in caches.values()] for e in sources]
    untouched = [page_bytes(c, 0) for c in caches.values()]
    pages.to_pool(group, sources, pool, slots)
    pages.from_pool(group, pool, slots, targets)
    for value, target in zip(expected, targets):
        assert [page_bytes(c, target) for c in caches.values()] == value
    assert [page_bytes(c, 0) for c in caches.values()] == untouched


def test_a_pool_slot_holds_each_layers_page_bytes_in_memory_order():
    """LBNHC (FlashAttention's): slot row l is layer l's page as it lies in memory, tokens outermost."""
    config, caches = uniform("LBNHC")
    groups = engine_groups(config, prefix_caching=False)
    pool = torch.zeros(4, NUM_LAYERS, 2 * BLOCK_SIZE * NUM_KV_HEADS * HEAD_DIM, dtype=torch.bfloat16)
    EnginePages(caches, groups, config).to_pool(groups.groups[0], [7], pool, [2])
    for layer, cache in enumerate(caches.values()):
        assert pool[2, layer].view(torch.uint8).numpy().tobytes() == page_bytes(cache, 7)
        assert not cache[7].is_contiguous()  # heads and tokens are swapped in memory


def hybrid_config(page_nbytes: int, num_blocks: int, mamba: bool):
    """Two groups of two layers whose layer i of each group alias one allocation (as vLLM lays out
    Gemma-3 and Qwen3-Next: one KVCacheTensor per layer index, holding a layer of every group)."""
    attention = vllm_fakes.FullAttentionSpec(BLOCK_SIZE, 1, page_nbytes // (4 * BLOCK_SIZE), torch.float16)
    other = vllm_fakes.MambaSpec(BLOCK_SIZE, page_nbytes) if mamba else \
        vllm_fakes.SlidingWindowSpec(BLOCK_SIZE, 1, page_nbytes // (4 * BLOCK_SIZE), torch.float16, 8)
    names = ["model.layers.0.mixer", "model.layers.1.attn", "model.layers.2.mixer", "model.layers.3.attn"]
    groups = [vllm_fakes.KVCacheGroupSpec([names[0], names[2]], other),
              vllm_fakes.KVCacheGroupSpec([names[1], names[3]], attention)]
    tensors = [vllm_fakes.KVCacheTensor(2 * num_blocks * page_nbytes, [names[0], names[2]], num_blocks * page_nbytes,
                                        page_nbytes),
               vllm_fakes.KVCacheTensor(2 * num_blocks * page_nbytes, [names[1], names[3]], num_blocks * page_nbytes,
                                        page_nbytes)]
    return vllm_fakes.KVCacheConfig("LBHNC", groups, tensors), names


@pytest.mark.parametrize("mamba", [False, True], ids=["sliding-window", "mamba"])
def test_groups_that_alias_one_allocation_move_their_own_blocks(mamba):
    """Group 0's block 3 and group 1's block 5 live in the same bytes' different blocks; each group's
    copy reads its own layers' pages of its own block ids, through int8 views (Mamba) or float16 ones."""
    page_nbytes, num_blocks = 256, 8
    config, names = hybrid_config(page_nbytes, num_blocks, mamba)
    raw = torch.randint(-128, 128, (2 * num_blocks * page_nbytes,), dtype=torch.int8,
                        generator=torch.Generator().manual_seed(5))
    by_layer = raw.view(2, num_blocks, page_nbytes)
    caches = {names[0]: by_layer[0] if mamba else by_layer[0].view(torch.float16),
              names[2]: by_layer[1] if mamba else by_layer[1].view(torch.float16),
              names[1]: by_layer[0].view(torch.float16), names[3]: by_layer[1].view(torch.float16)}
    groups = engine_groups(config, prefix_caching=True)
    pages = EnginePages(caches, groups, config)
    pool = torch.zeros(4, 2, page_nbytes // 2, dtype=torch.float16)
    pages.to_pool(groups.groups[0], [3], pool, [0])
    pages.to_pool(groups.groups[1], [5], pool, [1])
    slots = pool.view(torch.uint8)
    for layer in range(2):
        assert torch.equal(slots[0, layer].view(torch.int8), by_layer[layer, 3])
        assert torch.equal(slots[1, layer].view(torch.int8), by_layer[layer, 5])
    before = raw.clone()
    pages.from_pool(groups.groups[0], pool, [1], [6])  # group 1's bytes into group 0's block 6
    assert torch.equal(by_layer[:, 6], before.view(2, num_blocks, page_nbytes)[:, 5])
    assert torch.equal(raw.view(2, num_blocks, page_nbytes)[:, :6], before.view(2, num_blocks, page_nbytes)[:, :6])


def test_a_block_stride_from_the_kv_cache_tensor_wins_over_the_views_kernel_blocks():
    """With kernel blocks half the scheduler's, vLLM's view has twice the blocks at half the stride; the
    KVCacheTensor's block stride addresses a scheduler block as both its kernel pages."""
    page_nbytes, num_blocks = 128, 6
    spec = vllm_fakes.FullAttentionSpec(BLOCK_SIZE, 1, page_nbytes // (4 * BLOCK_SIZE), torch.float16)
    name = "model.layers.0.attn"
    tensor = vllm_fakes.KVCacheTensor(num_blocks * page_nbytes, [name], num_blocks * page_nbytes, page_nbytes)
    config = vllm_fakes.KVCacheConfig("LBHNC", [vllm_fakes.KVCacheGroupSpec([name], spec)], [tensor],
                                      num_blocks=num_blocks)
    raw = torch.arange(num_blocks * page_nbytes // 2, dtype=torch.float16)
    kernel_view = raw.view(2 * num_blocks, page_nbytes // 4)  # kernel blocks of half a page
    groups = engine_groups(config, prefix_caching=False)
    pool = torch.zeros(2, 1, page_nbytes // 2, dtype=torch.float16)
    EnginePages({name: kernel_view}, groups, config).to_pool(groups.groups[0], [4], pool, [1])
    assert torch.equal(pool[1, 0], raw.view(num_blocks, -1)[4])


def test_a_missing_layer_or_a_page_beyond_the_allocation_is_refused():
    config, caches = uniform("LBHNC")
    groups = engine_groups(config, prefix_caching=False)
    with pytest.raises(UnsupportedModel, match="no KV cache for layers"):
        EnginePages(dict(list(caches.items())[:2]), groups, config)
    shrunk = {name: torch.zeros(1, dtype=torch.bfloat16).expand(NUM_ENGINE_BLOCKS) for name in caches}
    with pytest.raises(UnsupportedModel, match="does not fit"):
        EnginePages(shrunk, groups, config)  # a block stride of 0 bytes
