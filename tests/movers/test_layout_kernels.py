"""Gather/scatter between per-layer engine caches and block-major slots, and cells of one buffer onto
cells of another: exact bytes, only the named blocks, validation before any write, one gather and one
scatter whatever the ids; the CUDA kernels match the torch reference."""

from __future__ import annotations

import pytest
import torch

from kvtierd.errors import InvalidArgument
from kvtierd.movers.layout_kernels import (
    copy_cells,
    copy_cells_reference,
    gather_blocks,
    gather_blocks_reference,
    scatter_blocks,
    scatter_blocks_reference,
    uses_cuda_kernel,
)
from tests.aten_ops import AtenOps
from tests.factories import small_layout

NUM_ENGINE_BLOCKS = 6
BIT_EXACT_DTYPES = (torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float32)


def random_bytes(shape, dtype, device="cpu", generator=None) -> torch.Tensor:
    """A tensor of `dtype` holding random bytes: NaN payloads, -0.0 and subnormals included."""
    numel = torch.Size(shape).numel() * dtype.itemsize
    raw = torch.randint(0, 256, (numel,), dtype=torch.uint8, generator=generator)
    return raw.view(dtype).view(shape).to(device)


def make_caches(dtype=torch.float16, num_engine_blocks=NUM_ENGINE_BLOCKS, device="cpu",
                **layout_overrides) -> list[torch.Tensor]:
    """vLLM-style caches, one [2, E, B, H, D] tensor per layer of small_layout(), random bytes."""
    num_layers, _, block_size, num_kv_heads, head_dim = small_layout(**layout_overrides).block_shape
    shape = (2, num_engine_blocks, block_size, num_kv_heads, head_dim)
    return [random_bytes(shape, dtype, device) for _ in range(num_layers)]


def slots_for(caches, num_blocks: int) -> torch.Tensor:
    _, _, block_size, num_kv_heads, head_dim = caches[0].shape
    shape = (num_blocks, len(caches), 2, block_size, num_kv_heads, head_dim)
    return random_bytes(shape, caches[0].dtype, caches[0].device)


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(torch.uint8)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(as_bytes(a), as_bytes(b))


@pytest.mark.parametrize("dtype", BIT_EXACT_DTYPES)
@pytest.mark.parametrize("ids_kind", ["list", "int64", "int32"])
def test_gather_picks_requested_blocks_in_block_major_order(dtype, ids_kind):
    """slots[i, layer, kv] is exactly layer_caches[layer][kv, block_ids[i]], repeats allowed."""
    caches = make_caches(dtype)
    block_ids = [4, 0, 4, 2]
    ids = block_ids if ids_kind == "list" else torch.tensor(block_ids, dtype=getattr(torch, ids_kind))
    slots = gather_blocks(caches, ids)
    expected = torch.stack([torch.stack([cache[:, b] for cache in caches]) for b in block_ids])
    assert slots.shape == (4, 2, 2, 4, 2, 8) and slots.is_contiguous()
    assert same_bytes(slots, expected)


def test_gather_writes_into_out_and_returns_it():
    caches = make_caches()
    out = slots_for(caches, 2)
    assert gather_blocks(caches, [5, 1], out=out) is out
    assert same_bytes(out[1, 1, 0], caches[1][0, 1])


@pytest.mark.parametrize("dtype", BIT_EXACT_DTYPES)
def test_scatter_writes_only_the_given_blocks(dtype):
    """Blocks 5 and 1 of every layer get the slots' bytes; the other engine blocks keep theirs."""
    caches = make_caches(dtype)
    before = [cache.clone() for cache in caches]
    slots = slots_for(caches, 2)
    scatter_blocks(slots, caches, [5, 1])
    for layer, cache in enumerate(caches):
        assert same_bytes(cache[:, 5], slots[0, layer])
        assert same_bytes(cache[:, 1], slots[1, layer])
        untouched = [0, 2, 3, 4]
        assert same_bytes(cache[:, untouched], before[layer][:, untouched])


@pytest.mark.parametrize("dtype", BIT_EXACT_DTYPES)
def test_scatter_then_gather_round_trips_bit_for_bit(dtype):
    caches = make_caches(dtype, num_kv_heads=3, head_dim=5)  # odd sizes: not 16-byte chunks
    slots = slots_for(caches, 3)
    scatter_blocks(slots, caches, [2, 0, 5])
    assert same_bytes(gather_blocks(caches, [2, 0, 5]), slots)


@pytest.mark.parametrize("dtype", BIT_EXACT_DTYPES)
def test_gather_then_scatter_leaves_caches_identical(dtype):
    caches = make_caches(dtype)
    before = [cache.clone() for cache in caches]
    slots = gather_blocks(caches, [3, 1])
    scatter_blocks(slots, caches, [3, 1])
    assert all(same_bytes(cache, old) for cache, old in zip(caches, before))


def test_moving_a_block_between_engine_ids():
    """gather at id 4, scatter to id 0: block 0 becomes a byte copy of block 4."""
    caches = make_caches()
    scatter_blocks(gather_blocks(caches, [4]), caches, [0])
    assert all(same_bytes(cache[:, 0], cache[:, 4]) for cache in caches)


def test_empty_block_ids_gather_nothing_and_scatter_nothing():
    caches = make_caches()
    before = [cache.clone() for cache in caches]
    assert gather_blocks(caches, []).shape == (0, 2, 2, 4, 2, 8)
    scatter_blocks(slots_for(caches, 0), caches, [])
    assert all(same_bytes(cache, old) for cache, old in zip(caches, before))


def test_public_api_matches_reference_on_cpu():
    caches = make_caches(torch.bfloat16)
    assert same_bytes(gather_blocks(caches, [1, 3]), gather_blocks_reference(caches, [1, 3]))
    slots = slots_for(caches, 2)
    copies = [cache.clone() for cache in caches]
    scatter_blocks(slots, caches, [0, 4])
    scatter_blocks_reference(slots, copies, [0, 4])
    assert all(same_bytes(a, b) for a, b in zip(caches, copies))


def _bad_gather_cases():
    ok = make_caches()
    shape = ok[0].shape
    return {
        "no layers": ([], [0], None),
        "not a list": (ok[0], [0], None),
        "4-d cache": ([ok[0][0]] * 2, [0], None),
        "first dim not 2": ([torch.zeros(3, *shape[1:], dtype=torch.float16)] * 2, [0], None),
        "layers differ in shape": ([ok[0], ok[1][:, :5].contiguous()], [0], None),
        "layers differ in dtype": ([ok[0], ok[1].to(torch.bfloat16)], [0], None),
        "layers on different devices": ([ok[0], torch.empty(shape, dtype=torch.float16, device="meta")], [0], None),
        "non-contiguous cache": (
            [ok[0], torch.zeros(2, 6, 4, 8, 2, dtype=torch.float16).transpose(3, 4)], [0], None),
        "8-byte dtype": ([torch.zeros(shape, dtype=torch.float64)] * 2, [0], None),
        "id too large": (ok, [0, NUM_ENGINE_BLOCKS], None),
        "negative id": (ok, [-1], None),
        "float id": (ok, [1.5], None),
        "float id tensor": (ok, torch.tensor([1.0]), None),
        "2-d id tensor": (ok, torch.tensor([[1]]), None),
        "ids not iterable": (ok, 3, None),
        "out wrong shape": (ok, [0], torch.empty(2, 2, 2, 4, 2, 8, dtype=torch.float16)),
        "out wrong dtype": (ok, [0], torch.empty(1, 2, 2, 4, 2, 8, dtype=torch.bfloat16)),
        "out other device": (ok, [0], torch.empty(1, 2, 2, 4, 2, 8, dtype=torch.float16, device="meta")),
        "out non-contiguous": (ok, [0, 1], torch.empty(2, 2, 2, 4, 8, 2, dtype=torch.float16).transpose(4, 5)),
    }


@pytest.mark.parametrize("case", list(_bad_gather_cases()))
def test_bad_gather_inputs_raise_invalid_argument(case):
    caches, ids, out = _bad_gather_cases()[case]
    with pytest.raises(InvalidArgument):
        gather_blocks(caches, ids, out=out)
    with pytest.raises(InvalidArgument):
        gather_blocks_reference(caches, ids, out=out)


@pytest.mark.parametrize("case", ["duplicate ids", "id out of range", "blocks wrong shape",
                                  "blocks missing", "blocks wrong dtype"])
def test_bad_scatter_inputs_raise_and_change_nothing(case):
    """A rejected scatter writes no byte, not even for its valid ids."""
    caches = make_caches()
    before = [cache.clone() for cache in caches]
    blocks, ids = slots_for(caches, 2), [1, 3]
    if case == "duplicate ids":
        ids = [3, 3]
    elif case == "id out of range":
        ids = [1, NUM_ENGINE_BLOCKS]
    elif case == "blocks wrong shape":
        blocks = slots_for(caches, 3)
    elif case == "blocks missing":
        blocks = None
    else:
        blocks = blocks.view(torch.bfloat16)
    with pytest.raises(InvalidArgument):
        scatter_blocks(blocks, caches, ids)
    assert all(same_bytes(cache, old) for cache, old in zip(caches, before))


# --- copy_cells: named cells of one buffer onto named cells of another ---------------------------

def cell_buffers(num_dst_cells: int, num_src_cells: int, cell_nbytes: int, offset: int = 0, device: str = "cpu"):
    """(dst, src): 1-D uint8 buffers of random bytes starting `offset` bytes into allocations of their own."""
    generator = torch.Generator().manual_seed(cell_nbytes + offset)
    dst, src = (torch.randint(0, 256, (n * cell_nbytes + offset,), dtype=torch.uint8, generator=generator)
                .to(device)[offset:] for n in (num_dst_cells, num_src_cells))
    return dst, src


def expected_cells(dst: torch.Tensor, dst_cells, src: torch.Tensor, src_cells, cell_nbytes: int) -> bytes:
    """dst's bytes after the copy, cell by cell in Python (None: cell i)."""
    out, source = bytearray(dst.cpu().numpy().tobytes()), src.cpu().numpy().tobytes()
    count = len(dst_cells if dst_cells is not None else src_cells)
    for i in range(count):
        d = i if dst_cells is None else dst_cells[i]
        s = i if src_cells is None else src_cells[i]
        out[d * cell_nbytes:(d + 1) * cell_nbytes] = source[s * cell_nbytes:(s + 1) * cell_nbytes]
    return bytes(out)


CELL_CASES = [([9, 0, 4, 2], [3, 3, 0, 7]),  # shuffled, a source cell read twice
              (None, [6, 1, 5]),  # a gather into contiguous cells
              ([8, 1, 5], None)]  # a scatter from contiguous cells


@pytest.mark.parametrize("offset", [0, 3])
@pytest.mark.parametrize("cell_nbytes", [1, 6, 64, 4096])
@pytest.mark.parametrize("dst_cells, src_cells", CELL_CASES, ids=["both", "gather", "scatter"])
@pytest.mark.parametrize("with_staging", [False, True])
def test_copy_cells_writes_exactly_the_named_cells(dst_cells, src_cells, cell_nbytes, offset, with_staging):
    """Cell dst_cells[i] gets src cell src_cells[i] (None: cell i), every other byte of dst stays, at any
    cell size and alignment, through a given staging buffer or a fresh one."""
    dst, src = cell_buffers(10, 8, cell_nbytes, offset)
    expected = expected_cells(dst, dst_cells, src, src_cells, cell_nbytes)
    staging = torch.empty(4 * cell_nbytes + 8, dtype=torch.uint8) if with_staging else None
    copy_cells(dst, dst_cells, src, src_cells, cell_nbytes, staging=staging)
    assert dst.numpy().tobytes() == expected


@pytest.mark.parametrize("dst_cells, src_cells", CELL_CASES, ids=["both", "gather", "scatter"])
def test_copy_cells_is_one_gather_and_one_scatter_whatever_the_ids(dst_cells, src_cells):
    """The torch path (CPU; CUDA without CuPy) issues the same ops for every cell its own run as for one
    run: an index_select and an index_copy_, one of them where a side is contiguous."""
    counts = []
    for shuffled in (False, True):
        dst, src = cell_buffers(16, 16, 64)
        count = len(dst_cells if dst_cells is not None else src_cells)
        runs = list(range(count)) if not shuffled else [15 - 2 * i for i in range(count)]
        with AtenOps() as ops:
            copy_cells(dst, None if dst_cells is None else runs, src, None if src_cells is None else runs[::-1], 64)
        counts.append(ops.data_ops())
    expected = {"index_select": 1} if dst_cells is None else \
        {"index_copy_": 1} if src_cells is None else {"index_select": 1, "index_copy_": 1}
    assert counts == [expected, expected]


def test_copy_cells_reference_matches_copy_cells():
    dst, src = cell_buffers(10, 8, 24, 1)
    expected = dst.clone()
    copy_cells_reference(expected, [1, 7, 2], src, [0, 0, 5], 24)
    copy_cells(dst, [1, 7, 2], src, [0, 0, 5], 24)
    assert torch.equal(dst, expected)


BAD_CELL_CASES = {
    "dst cell out of range": lambda dst, src: copy_cells(dst, [0, 10], src, [0, 1], 16),
    "negative src cell": lambda dst, src: copy_cells(dst, [0, 1], src, [0, -1], 16),
    "lengths differ": lambda dst, src: copy_cells(dst, [0, 1], src, [0], 16),
    "no ids at all": lambda dst, src: copy_cells(dst, None, src, None, 16),
    "contiguous side too short": lambda dst, src: copy_cells(dst, list(range(9)), src, None, 16),
    "cell size zero": lambda dst, src: copy_cells(dst, [0], src, [0], 0),
    "not bytes": lambda dst, src: copy_cells(dst.view(torch.int16), [0], src.view(torch.int16), [0], 16),
    "2-D buffer": lambda dst, src: copy_cells(dst.view(10, 16), [0], src, [0], 16),
    "overlapping buffers": lambda dst, src: copy_cells(dst[:80], [0], dst[64:], [1], 16),
}


@pytest.mark.parametrize("case", sorted(BAD_CELL_CASES))
def test_bad_copy_cells_inputs_raise_invalid_argument_and_change_nothing(case):
    dst, src = cell_buffers(10, 8, 16)
    before = dst.clone()
    with pytest.raises(InvalidArgument):
        BAD_CELL_CASES[case](dst, src)
    assert torch.equal(dst, before)


# --- CUDA: the kernel writes exactly the reference's bytes ---------------------------------

GPU_GEOMETRIES = [dict(), dict(num_layers=3, block_size=16, num_kv_heads=8, head_dim=128),
                  dict(num_layers=1, block_size=3, num_kv_heads=1, head_dim=5)]
LLAMA3_8B_GEOMETRY = dict(num_layers=32, block_size=16, num_kv_heads=8, head_dim=128)


@pytest.fixture
def cupy_kernels():
    pytest.importorskip("cupy", reason="the CUDA kernels need CuPy")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", BIT_EXACT_DTYPES)
@pytest.mark.parametrize("geometry", GPU_GEOMETRIES, ids=lambda g: str(sorted(g.items())))
def test_cuda_gather_and_scatter_match_reference(cupy_kernels, dtype, geometry):
    caches = make_caches(dtype, num_engine_blocks=40, device="cuda", **geometry)
    check_cuda_gather_and_scatter(caches, torch.randperm(40)[:17].tolist(), repeats=[7, 7])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16, torch.float8_e4m3fn))
def test_cuda_gather_and_scatter_match_reference_at_llama3_8b_size(cupy_kernels, dtype):
    """Real sizes: 32 layers of [2, 300, 16, 8, 128] caches (2 MiB blocks in fp16), a 4k-token request's
    256 blocks in shuffled order gathered, then scattered back, the reference's bytes both ways."""
    caches = make_caches(dtype, num_engine_blocks=300, device="cuda", **LLAMA3_8B_GEOMETRY)
    check_cuda_gather_and_scatter(caches, torch.randperm(300)[:256].tolist())


def check_cuda_gather_and_scatter(caches: list[torch.Tensor], ids: list[int], repeats: list[int] = ()) -> None:
    """Gather of `ids` + `repeats` and scatter of `ids` write exactly the torch reference's bytes."""
    assert uses_cuda_kernel(caches[0])
    gather_ids = ids + list(repeats)
    assert same_bytes(gather_blocks(caches, gather_ids).cpu(),
                      gather_blocks_reference([c.cpu() for c in caches], gather_ids))
    slots = slots_for(caches, len(ids))
    expected = [c.cpu() for c in caches]
    scatter_blocks_reference(slots.cpu(), expected, ids)
    scatter_blocks(slots, caches, ids)
    torch.cuda.synchronize()
    assert all(same_bytes(c.cpu(), e) for c, e in zip(caches, expected))


@pytest.mark.gpu
@pytest.mark.parametrize("offset_elements", [1, 2, 4])
def test_cuda_kernels_handle_unaligned_caches(cupy_kernels, offset_elements):
    """Caches starting 2, 4 or 8 bytes into an allocation use a smaller copy unit, same bytes."""
    shape = (2, 9, 4, 2, 8)
    numel = torch.Size(shape).numel()
    buffers = [random_bytes((numel + offset_elements,), torch.float16, "cuda") for _ in range(2)]
    caches = [b[offset_elements:].view(shape) for b in buffers]
    ids = [8, 0, 3]
    assert same_bytes(gather_blocks(caches, ids).cpu(),
                      gather_blocks_reference([c.cpu() for c in caches], ids))


@pytest.mark.gpu
def test_cuda_gather_runs_on_torchs_current_stream(cupy_kernels):
    caches = make_caches(device="cuda", num_engine_blocks=64)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        slots = gather_blocks(caches, list(range(64)))
        copy = slots.clone()  # ordered after the kernel only if it ran on `stream`
    stream.synchronize()
    assert same_bytes(copy.cpu(), gather_blocks_reference([c.cpu() for c in caches], list(range(64))))


@pytest.mark.gpu
@pytest.mark.parametrize("offset", [0, 2, 8])
@pytest.mark.parametrize("cell_nbytes", [6, 64, 65536])
@pytest.mark.parametrize("dst_cells, src_cells", CELL_CASES, ids=["both", "gather", "scatter"])
def test_cuda_copy_cells_matches_reference(cupy_kernels, dst_cells, src_cells, cell_nbytes, offset):
    """The kernel writes the named cells as the Python reference does, at any alignment (its copy unit
    shrinks to what the addresses allow), a contiguous side or none."""
    dst, src = cell_buffers(10, 8, cell_nbytes, offset, device="cuda")
    assert uses_cuda_kernel(dst)
    expected = expected_cells(dst, dst_cells, src, src_cells, cell_nbytes)
    copy_cells(dst, dst_cells, src, src_cells, cell_nbytes)
    torch.cuda.synchronize()
    assert dst.cpu().numpy().tobytes() == expected


@pytest.mark.gpu
def test_cuda_copy_cells_of_a_fragmented_512_mib_store_match_reference(cupy_kernels):
    """The connector's case at the issue's size: 256 blocks x 32 layers of 64 KiB pages, every block its
    own run on both sides, in one launch; the bytes of the torch reference."""
    num_pages, cell_nbytes = 256 * 32, 65536
    dst, src = cell_buffers(2 * num_pages, 2 * num_pages, cell_nbytes, device="cuda")
    src_cells = torch.randperm(2 * num_pages)[:num_pages]
    dst_cells = torch.randperm(num_pages) * 2
    expected = dst.clone()
    copy_cells_reference(expected, dst_cells, src, src_cells, cell_nbytes)
    copy_cells(dst, dst_cells, src, src_cells, cell_nbytes)
    assert torch.equal(dst, expected)
