"""The engine's KV pages as the vLLM connector moves them, without a daemon: views built as vLLM 0.32
builds them (tests/connectors/vllm/vllm_fakes.py `vllm_kv_caches`, for every KVCacheLayout), and the
shapes the probe of real engines showed for hybrid models: groups whose layers alias one allocation
(Gemma-3, gpt-oss), Mamba state pages as int8 views (Qwen3-Next), MLA latents (DeepSeek-V2). A move is
one gather and one scatter whatever the ids: the aten ops it issues are counted."""

from __future__ import annotations

import collections
import threading

import pytest
import torch

from kvtierd.connectors.vllm.cell_moves import HostStaging, move_cells
from kvtierd.connectors.vllm.engine_pages import EnginePages
from kvtierd.connectors.vllm.kv_groups import EngineGroups, GroupKind, ServedGroup, UnsupportedModel, engine_groups
from kvtierd.movers import span_copy
from tests.aten_ops import DATA_OPS, AtenOps
from tests.connectors.vllm import vllm_fakes
from tests.connectors.vllm.vllm_fakes import KV_CACHE_LAYOUTS, vllm_kv_caches

NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_ENGINE_BLOCKS = 3, 2, 4, 4, 10
PAGE_ELEMENTS = 2 * BLOCK_SIZE * NUM_KV_HEADS * HEAD_DIM  # one layer's page of one block, in bf16
# 8 blocks as one run on both sides, and as 8 runs (shuffled engine ids, no two pool ids adjacent)
CONTIGUOUS = (list(range(8)), list(range(8)))
FRAGMENTED = ([9, 2, 14, 5, 0, 11, 7, 3], [14, 0, 12, 2, 10, 4, 8, 6])
PAGE_BYTE_OPS = DATA_OPS | {"native copy_spans"}  # what could move a page's bytes


def uniform(layout_name: str, num_layers: int = NUM_LAYERS, num_engine_blocks: int = NUM_ENGINE_BLOCKS,
            device: str = "cpu"):
    """A one-group model's (config, caches), the caches filled with random bf16 bits (the same on any device)."""
    caches = vllm_kv_caches(layout_name, num_layers, num_engine_blocks, NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM,
                            torch.bfloat16, device)
    for index, cache in enumerate(caches.values()):
        cache.copy_(torch.randn(cache.shape, generator=torch.Generator().manual_seed(index)).to(torch.bfloat16))
    spec = vllm_fakes.FullAttentionSpec(BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, torch.bfloat16)
    config = vllm_fakes.KVCacheConfig(layout_name, [vllm_fakes.KVCacheGroupSpec(list(caches), spec)])
    return config, caches


def move(pages: EnginePages, pool: torch.Tensor, ids: tuple[list[int], list[int]], direction: str) -> None:
    """A store (engine ids[0] -> pool ids[1]) or a load (the reverse) of the first group."""
    group = pages.engine.groups[0]
    if direction == "store":
        pages.to_pool(group, ids[0], pool, ids[1])
    else:
        pages.from_pool(group, pool, ids[1], ids[0])


def counted_ops(pages: EnginePages, pool: torch.Tensor, ids: tuple[list[int], list[int]],
                direction: str) -> collections.Counter[str]:
    """The aten ops of one move, and (as "native copy_spans") the calls of span_copy's C extension."""
    NATIVE_CALLS.pop(threading.get_ident(), None)
    with AtenOps() as ops:
        move(pages, pool, ids, direction)
    return ops.counts + NATIVE_CALLS.pop(threading.get_ident(), collections.Counter())


NATIVE_CALLS: dict[int, collections.Counter[str]] = {}  # thread -> calls of the C extension (host_copy "native")


@pytest.fixture(params=["native", "torch"])
def host_copy(request, monkeypatch) -> str:
    """Host-to-host copies through span_copy's C extension (calls counted, each still copying), or
    through torch's index ops (span_copy without its extension: what a host without a compiler runs)."""
    native = span_copy._NATIVE
    if request.param == "torch":
        monkeypatch.setattr(span_copy, "_NATIVE", None)
    else:
        assert native is not None, "the C extension builds wherever a compiler is (setup.py)"

        def copy_spans(*args):
            NATIVE_CALLS.setdefault(threading.get_ident(), collections.Counter())["native copy_spans"] += 1
            return native.copy_spans(*args)

        monkeypatch.setattr(span_copy, "_NATIVE", type("Counting", (), {"copy_spans": staticmethod(copy_spans)}))
    return request.param


def page_bytes(cache: torch.Tensor, block_id: int) -> bytes:
    """A layer's page of one block, in memory order, independent of the module under test."""
    block = cache[block_id]
    order = sorted(range(block.dim()), key=lambda axis: -block.stride(axis))
    return block.permute(*order).contiguous().view(torch.uint8).numpy().tobytes()


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


@pytest.mark.parametrize("layout_name", sorted(KV_CACHE_LAYOUTS))
def test_a_pool_slot_holds_each_layers_page_bytes_in_memory_order(layout_name):
    """Every layout (LBNHC: FlashAttention's, tokens outermost; LBHNC: CPU_ATTN's; LHBNC / BHLNC: pages
    split across memory; block-outermost ones): slot row l of a fragmented store is layer l's page as it
    lies in memory; the slots not named keep their bytes."""
    config, caches = uniform(layout_name, num_engine_blocks=16)
    groups = engine_groups(config, prefix_caching=False)
    pool = torch.full((16, NUM_LAYERS, PAGE_ELEMENTS), 7.0, dtype=torch.bfloat16)
    EnginePages(caches, groups, config).to_pool(groups.groups[0], FRAGMENTED[0], pool, FRAGMENTED[1])
    for engine_id, slot in zip(*FRAGMENTED):
        for layer, cache in enumerate(caches.values()):
            assert pool[slot, layer].view(torch.uint8).numpy().tobytes() == page_bytes(cache, engine_id)
    untouched = sorted(set(range(16)) - set(FRAGMENTED[1]))
    assert torch.equal(pool[untouched], torch.full((len(untouched), NUM_LAYERS, PAGE_ELEMENTS), 7.0,
                                                   dtype=torch.bfloat16))


@pytest.mark.parametrize("direction", ["store", "load"])
@pytest.mark.parametrize("layout_name", sorted(KV_CACHE_LAYOUTS))
def test_a_fragmented_move_issues_the_ops_of_a_contiguous_one_whatever_the_layers(layout_name, direction,
                                                                                  host_copy):
    """8 blocks in 8 runs issue exactly the aten ops of 8 blocks in one run, at 3 layers as at 8: the page
    bytes of every layer move in one call of the C extension, or in one gather and one scatter (the
    loop before issued 2 ops per run per layer)."""
    counts = {}
    for num_layers in (3, 8):
        config, caches = uniform(layout_name, num_layers, num_engine_blocks=16)
        groups = engine_groups(config, prefix_caching=False)
        pages = EnginePages(caches, groups, config)
        pool = torch.zeros(16, num_layers, PAGE_ELEMENTS, dtype=torch.bfloat16)
        move(pages, pool, CONTIGUOUS, direction)  # the first move allocates the thread's host buffer
        for name, ids in (("contiguous", CONTIGUOUS), ("fragmented", FRAGMENTED)):
            counts[num_layers, name] = counted_ops(pages, pool, ids, direction)
    assert all(count == counts[3, "contiguous"] for count in counts.values()), counts
    page_ops = {name: n for name, n in counts[8, "fragmented"].items() if name in PAGE_BYTE_OPS}
    expected = {"native copy_spans": 1} if host_copy == "native" else {"index_select": 1, "index_copy_": 1}
    assert page_ops == expected, counts[8, "fragmented"]


def test_layers_in_allocations_of_their_own_move_with_a_gather_and_a_scatter_each(host_copy):
    """Layers that do not share one allocation (vLLM 0.32 always shares one; the connector still takes
    such views) move per allocation: one copy call, or 2 ops, per layer, the same for any ids, bytes exact."""
    config, shared = uniform("LBHNC", num_engine_blocks=16)
    caches = {name: cache.clone() for name, cache in shared.items()}
    groups = engine_groups(config, prefix_caching=False)
    pages = EnginePages(caches, groups, config)
    pool = torch.zeros(16, NUM_LAYERS, PAGE_ELEMENTS, dtype=torch.bfloat16)
    move(pages, pool, CONTIGUOUS, "store")
    counts = [counted_ops(pages, pool, ids, "store") for ids in (CONTIGUOUS, FRAGMENTED)]
    assert counts[0] == counts[1]
    expected = {"native copy_spans": NUM_LAYERS} if host_copy == "native" else \
        {"index_select": NUM_LAYERS, "index_copy_": NUM_LAYERS}
    assert {name: n for name, n in counts[1].items() if name in PAGE_BYTE_OPS} == expected
    for engine_id, slot in zip(*FRAGMENTED):
        for layer, cache in enumerate(caches.values()):
            assert pool[slot, layer].view(torch.uint8).numpy().tobytes() == page_bytes(cache, engine_id)


def test_mla_latent_pages_round_trip_bit_exact():
    """DeepSeek-V2's latent cache, one `[blocks, 1, block_size, 576]` bf16 view per layer of one allocation
    (as vLLM 0.32 registers it), served as opaque pages: a fragmented store and a load into other blocks."""
    num_layers, num_blocks, latent = 2, 16, 576
    raw = torch.randint(-128, 128, (num_layers * num_blocks * BLOCK_SIZE * latent * 2,), dtype=torch.int8,
                        generator=torch.Generator().manual_seed(3))
    views = raw.view(torch.bfloat16).view(num_layers, num_blocks, 1, BLOCK_SIZE, latent)
    names = tuple(f"model.layers.{layer}.self_attn.attn" for layer in range(num_layers))
    page_nbytes = BLOCK_SIZE * latent * 2
    group = ServedGroup(0, GroupKind.FULL, names, page_nbytes, BLOCK_SIZE)
    pages = EnginePages(dict(zip(names, views)), EngineGroups((group,), BLOCK_SIZE, BLOCK_SIZE, page_nbytes, False),
                        None, num_blocks)
    pool = torch.zeros(16, num_layers, page_nbytes, dtype=torch.uint8)
    pages.to_pool(group, FRAGMENTED[0][:4], pool, FRAGMENTED[1][:4])
    before = raw.clone().view(num_layers, num_blocks, page_nbytes)
    pages.from_pool(group, pool, FRAGMENTED[1][:4], [15, 13, 1, 8])
    after = raw.view(num_layers, num_blocks, page_nbytes)
    for source, target in zip(FRAGMENTED[0][:4], [15, 13, 1, 8]):
        assert torch.equal(after[:, target], before[:, source])
    assert torch.equal(after[:, [4, 6, 10, 12]], before[:, [4, 6, 10, 12]])


@pytest.mark.parametrize("engine_ids, pool_ids, match", [
    ([1, 16], [0, 1], r"engine block ids must be in \[0, 16\)"), ([1, -1], [0, 1], "engine block ids"),
    ([1, 2], [0, 16], r"pool block ids must be in \[0, 16\)"), ([1, 2, 3], [0, 1], "3 engine blocks for 2")])
@pytest.mark.parametrize("direction", ["store", "load"])
def test_bad_ids_are_refused_before_a_byte_moves(engine_ids, pool_ids, match, direction):
    config, caches = uniform("LBNHC", num_engine_blocks=16)
    groups = engine_groups(config, prefix_caching=False)
    pages = EnginePages(caches, groups, config)
    pool = torch.randn(16, NUM_LAYERS, PAGE_ELEMENTS).to(torch.bfloat16)
    engine_before, pool_before = [page_bytes(c, b) for c in caches.values() for b in range(16)], pool.clone()
    with pytest.raises(ValueError, match=match):
        move(pages, pool, (engine_ids, pool_ids), direction)
    with pytest.raises(ValueError, match="not contiguous slots"):
        move(pages, pool[:, :2], ([1], [0]), direction)
    assert [page_bytes(c, b) for c in caches.values() for b in range(16)] == engine_before
    assert torch.equal(pool, pool_before)


def test_a_move_larger_than_the_host_buffer_goes_through_it_in_chunks():
    """7 cells of 64 bytes through a host buffer of 3 cells: the named cells' bytes, nothing else; the
    thread keeps a buffer of at most a chunk."""
    staging = HostStaging(pinned=False, chunk_nbytes=3 * 64)
    src = torch.randint(0, 256, (20 * 64,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    dst = torch.zeros(30 * 64, dtype=torch.uint8)
    src_cells, dst_cells = [19, 3, 7, 0, 12, 5, 8], [29, 0, 14, 2, 20, 4, 6]
    move_cells(dst, torch.tensor(dst_cells), src, torch.tensor(src_cells), 64, staging)
    expected = torch.zeros(30, 64, dtype=torch.uint8)
    for d, s in zip(dst_cells, src_cells):
        expected[d] = src.view(20, 64)[s]
    assert torch.equal(dst.view(30, 64), expected)
    assert staging.buffer(1).untyped_storage().nbytes() <= 3 * 64
    with pytest.raises(ValueError, match="destination cells must be in"):
        move_cells(dst, torch.tensor([30]), src, torch.tensor([0]), 64, staging)
    assert torch.equal(dst.view(30, 64), expected)


def test_host_staging_keeps_one_buffer_per_thread():
    """A thread gets its own buffer back (no fresh allocation per copy); another thread never gets it;
    a request above the chunk size is served once and not kept."""
    staging = HostStaging(pinned=False, chunk_nbytes=1024)
    first = staging.buffer(512)
    assert staging.buffer(256).data_ptr() == first.data_ptr()
    other: list[int] = []
    thread = threading.Thread(target=lambda: other.append(staging.buffer(512).data_ptr()))
    thread.start()
    thread.join()
    assert other and other[0] != first.data_ptr()
    assert staging.buffer(4096).numel() == 4096
    assert staging.buffer(512).data_ptr() == first.data_ptr()


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
    """Group 0's blocks 3, 0 and group 1's blocks 5, 2 live in the same bytes' different blocks; each
    group's copy reads its own layers' pages of its own block ids, through int8 views (Mamba) or float16
    ones, into scattered slots, and a load writes only the blocks it names."""
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
    pages.to_pool(groups.groups[0], [3, 0], pool, [0, 3])
    pages.to_pool(groups.groups[1], [5, 2], pool, [2, 1])
    slots = pool.view(torch.uint8)
    for layer in range(2):
        for slot, block in ((0, 3), (3, 0), (2, 5), (1, 2)):
            assert torch.equal(slots[slot, layer].view(torch.int8), by_layer[layer, block])
    before = raw.clone().view(2, num_blocks, page_nbytes)
    pages.from_pool(groups.groups[0], pool, [2, 1], [7, 6])  # group 1's bytes into group 0's blocks 7, 6
    assert torch.equal(by_layer[:, 7], before[:, 5]) and torch.equal(by_layer[:, 6], before[:, 2])
    assert torch.equal(raw.view(2, num_blocks, page_nbytes)[:, :6], before[:, :6])


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


# --- CUDA: the engine on the GPU, the pool beside it or on the host --------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("pool_device", ["cuda", "cpu"])
@pytest.mark.parametrize("layout_name", sorted(KV_CACHE_LAYOUTS))
def test_on_cuda_a_fragmented_store_and_load_write_the_cpu_paths_bytes(layout_name, pool_device):
    """The kernel (pool on the GPU) and the gather / transfer / scatter (pool on the host) write exactly
    the bytes of the CPU path, a store into scattered slots and a load into other blocks."""
    moved = {}
    for device in ("cpu", "cuda"):
        config, caches = uniform(layout_name, num_engine_blocks=16, device=device)
        groups = engine_groups(config, prefix_caching=False)
        pages = EnginePages(caches, groups, config)
        pool = torch.zeros(16, NUM_LAYERS, PAGE_ELEMENTS, dtype=torch.bfloat16,
                           device=pool_device if device == "cuda" else "cpu")
        move(pages, pool, FRAGMENTED, "store")
        move(pages, pool, ([1, 4, 6, 8, 10, 12, 13, 15], FRAGMENTED[1]), "load")
        torch.cuda.synchronize()
        moved[device] = [pool.cpu(), *(cache.cpu().contiguous() for cache in caches.values())]
    assert all(torch.equal(on_cuda.view(torch.uint8), on_cpu.view(torch.uint8))
               for on_cuda, on_cpu in zip(moved["cuda"], moved["cpu"], strict=True))


@pytest.mark.gpu
@pytest.mark.parametrize("direction", ["store", "load"])
def test_on_cuda_a_fragmented_move_launches_what_a_contiguous_one_does(direction):
    """The GPU work of a move (kernels and copies, as the CUDA profiler sees them) is the same list for 8
    runs as for one: no launch per run, none per layer."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    config, caches = uniform("LBNHC", num_layers=8, num_engine_blocks=16, device="cuda")
    groups = engine_groups(config, prefix_caching=False)
    pages = EnginePages(caches, groups, config)
    pool = torch.zeros(16, 8, PAGE_ELEMENTS, dtype=torch.bfloat16, device="cuda")
    move(pages, pool, CONTIGUOUS, direction)  # compiles the kernel
    launched = []
    for ids in (CONTIGUOUS, FRAGMENTED):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            move(pages, pool, ids, direction)
            torch.cuda.synchronize()
        launched.append(sorted(event.name for event in prof.events() if event.device_type == DeviceType.CUDA))
    assert launched[0] == launched[1] and 0 < len(launched[0]) <= 3, launched
