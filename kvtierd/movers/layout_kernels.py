"""Gather and scatter between an engine's per-layer KV caches and block-major slots.

An engine such as vLLM keeps one contiguous tensor per layer, `[2, num_engine_blocks,
block_size, num_kv_heads, head_dim]`; kvtierd stores a block as one contiguous slot,
`[num_layers, 2, block_size, num_kv_heads, head_dim]` (docs/architecture.md §3). `gather_blocks` packs
the per-layer pieces of the given engine blocks into slots, `scatter_blocks` writes them back:
    slots[i, layer, kv] == layer_caches[layer][kv, block_ids[i]]
Both move raw bytes, never values, so they are bit exact for every 1-, 2- or 4-byte dtype
(fp16, bf16, fp8 e4m3, fp32), and `scatter(gather(x))` restores x exactly.

`copy_cells` is the layout-free form the vLLM connector uses (its engine pages may lie anywhere in
one allocation): two byte buffers seen as arrays of equal cells, cell `dst_cells[i]` of one getting
cell `src_cells[i]` of the other, whatever the ids: one launch on CUDA, two torch index ops else.

CUDA tensors with CuPy installed run kernels/kv_layout.cu on torch's current stream; everything
else (CPU tensors, CUDA without CuPy) runs the torch reference, which writes the same bytes.
Every input is validated (InvalidArgument) before anything is written.
"""

from __future__ import annotations

import math
import operator
from typing import Sequence

import numpy as np
import torch

from kvtierd.errors import InvalidArgument
from kvtierd.movers.cuda_kernels import launch_kernel, load_kernel, uses_cuda_kernel

KERNEL_SOURCE = "kv_layout.cu"
GATHER_KERNEL = "kv_gather_blocks"
SCATTER_KERNEL = "kv_scatter_blocks"
CELLS_KERNEL = "kv_copy_cells"
# Every kernel name this module launches, by source file; tests check them in the compiled code.
KERNEL_NAMES: dict[str, tuple[str, ...]] = {KERNEL_SOURCE: (GATHER_KERNEL, SCATTER_KERNEL, CELLS_KERNEL)}

THREADS_PER_BLOCK = 256
_MAX_GRID_X, _MAX_GRID_Y = 1 << 20, 65535  # the kernels grid-stride past these
BlockIds = Sequence[int] | torch.Tensor
# The widest integer dtype whose elements a byte count and its addresses divide into: the torch
# path copies cells as rows of these (bytes all the same), 8 bytes a step instead of one.
_UNIT_DTYPES = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))


def _check_layer_caches(layer_caches: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Layer caches: a non-empty list of contiguous `[2, E, B, H, D]` tensors, all alike."""
    if (not isinstance(layer_caches, (list, tuple)) or not layer_caches
            or not all(isinstance(cache, torch.Tensor) for cache in layer_caches)):
        raise InvalidArgument("layer_caches must be a non-empty list of tensors")
    first = layer_caches[0]
    if first.dim() != 5 or first.shape[0] != 2 or first.dtype.itemsize not in (1, 2, 4):
        raise InvalidArgument(
            f"a layer cache must be [2, num_engine_blocks, block_size, heads, dim] of a 1-, 2- "
            f"or 4-byte dtype, got {tuple(first.shape)} {first.dtype}")
    for layer, cache in enumerate(layer_caches):
        if (cache.shape, cache.dtype, cache.device) != (first.shape, first.dtype, first.device):
            raise InvalidArgument(
                f"layer {layer} cache is {tuple(cache.shape)} {cache.dtype} on {cache.device}, "
                f"layer 0 is {tuple(first.shape)} {first.dtype} on {first.device}")
        if not cache.is_contiguous():
            raise InvalidArgument(f"layer {layer} cache must be contiguous")
    return list(layer_caches)


def _check_block_ids(block_ids: BlockIds, num_engine_blocks: int, *, unique: bool,
                     what: str = "block_ids") -> torch.Tensor:
    """Block ids as a 1-D int64 CPU tensor, each in [0, num_engine_blocks), unique if asked."""
    if isinstance(block_ids, torch.Tensor):
        if block_ids.dim() != 1 or block_ids.dtype not in (torch.int32, torch.int64):
            raise InvalidArgument(f"{what} must be a 1-D int32/int64 tensor, got "
                                  f"{block_ids.dtype} {tuple(block_ids.shape)}")
        ids = block_ids.to("cpu", torch.int64)
    else:
        try:
            ids = torch.tensor([operator.index(b) for b in block_ids], dtype=torch.int64)
        except (TypeError, RuntimeError) as e:
            raise InvalidArgument(f"{what} must be integers: {e}") from e
    if ids.numel() >= 2**31:
        raise InvalidArgument(f"too many {what} ({ids.numel()})")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_engine_blocks):
        raise InvalidArgument(f"{what} must be in [0, {num_engine_blocks}), got min "
                              f"{int(ids.min())} max {int(ids.max())}")
    if unique and torch.unique(ids).numel() != ids.numel():
        raise InvalidArgument(f"scatter {what} must be unique (two writes to one block)")
    return ids


def _prepare(layer_caches: Sequence[torch.Tensor], block_ids: BlockIds, slots: torch.Tensor | None, name: str, *,
             is_scatter: bool) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Validate everything; allocate gather's `out` when it is None. Returns caches, ids, slots."""
    caches = _check_layer_caches(layer_caches)
    ids = _check_block_ids(block_ids, caches[0].shape[1], unique=is_scatter)
    first = caches[0]
    shape = (ids.numel(), len(caches), *first.shape[:1], *first.shape[2:])
    if slots is None and not is_scatter:
        slots = torch.empty(shape, dtype=first.dtype, device=first.device)
    if not isinstance(slots, torch.Tensor):
        raise InvalidArgument(f"{name} must be a torch tensor")
    if (tuple(slots.shape), slots.dtype, slots.device) != (shape, first.dtype, first.device):
        raise InvalidArgument(
            f"{name} must be {shape} {first.dtype} on {first.device} like the layer caches, "
            f"got {tuple(slots.shape)} {slots.dtype} on {slots.device}")
    if not slots.is_contiguous():
        raise InvalidArgument(f"{name} must be contiguous")
    return caches, ids, slots


# --- Public API ----------------------------------------------------------------------------

def gather_blocks(layer_caches: Sequence[torch.Tensor], block_ids: BlockIds,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """Pack engine blocks `block_ids` into slots `[n, num_layers, 2, B, H, D]` (returned).

    `out`, if given, must be contiguous, of that shape, dtype and device, and must not overlap
    the layer caches. Ids may repeat. Asynchronous on CUDA (torch's current stream).
    """
    caches, ids, out = _prepare(layer_caches, block_ids, out, "out", is_scatter=False)
    if ids.numel() and uses_cuda_kernel(out):
        _launch_layout_kernel(GATHER_KERNEL, caches, ids, out)
    elif ids.numel():
        _gather_torch(caches, ids, out)
    return out


def scatter_blocks(blocks: torch.Tensor, layer_caches: Sequence[torch.Tensor],
                   block_ids: BlockIds) -> None:
    """Write slots `blocks[i]` into engine block `block_ids[i]` of every layer cache.

    Ids must be unique; engine blocks not named are left untouched.
    """
    caches, ids, blocks = _prepare(layer_caches, block_ids, blocks, "blocks", is_scatter=True)
    if ids.numel() and uses_cuda_kernel(blocks):
        _launch_layout_kernel(SCATTER_KERNEL, caches, ids, blocks)
    elif ids.numel():
        _scatter_torch(blocks, caches, ids)


def gather_blocks_reference(layer_caches: Sequence[torch.Tensor], block_ids: BlockIds,
                            out: torch.Tensor | None = None) -> torch.Tensor:
    """`gather_blocks` in plain torch, on any device."""
    caches, ids, out = _prepare(layer_caches, block_ids, out, "out", is_scatter=False)
    _gather_torch(caches, ids, out)
    return out


def scatter_blocks_reference(blocks: torch.Tensor, layer_caches: Sequence[torch.Tensor],
                             block_ids: BlockIds) -> None:
    """`scatter_blocks` in plain torch, on any device."""
    caches, ids, blocks = _prepare(layer_caches, block_ids, blocks, "blocks", is_scatter=True)
    _scatter_torch(blocks, caches, ids)


def copy_cells(dst: torch.Tensor, dst_cells: BlockIds | None, src: torch.Tensor, src_cells: BlockIds | None,
               cell_nbytes: int, *, staging: torch.Tensor | None = None) -> None:
    """Cell `dst_cells[i]` of `dst` = cell `src_cells[i]` of `src`; cell c is bytes
    `[c * cell_nbytes, (c + 1) * cell_nbytes)`, and None for a side's ids means cell i (a
    contiguous gather or scatter).

    `dst` and `src`: distinct 1-D uint8 buffers on one device. Everything is validated before a
    byte is written; a cell named twice as a destination gets one of its sources' bytes. On CUDA
    with CuPy: one launch (and one copy of the ids to the device) on torch's current stream,
    asynchronous. Else torch's `index_select` then `index_copy_`, the bytes passing through
    `staging` (a uint8 buffer on the device, at least a cell per id; a fresh one when None).
    """
    dst_ids, src_ids, num_cells = _check_cells(dst, dst_cells, src, src_cells, cell_nbytes)
    if num_cells and uses_cuda_kernel(dst):
        _launch_cells_kernel(dst, dst_ids, src, src_ids, num_cells, cell_nbytes)
    elif num_cells:
        _copy_cells_torch(dst, dst_ids, src, src_ids, num_cells, cell_nbytes, staging)


def copy_cells_reference(dst: torch.Tensor, dst_cells: BlockIds | None, src: torch.Tensor,
                         src_cells: BlockIds | None, cell_nbytes: int) -> None:
    """`copy_cells` in plain torch, on any device."""
    dst_ids, src_ids, num_cells = _check_cells(dst, dst_cells, src, src_cells, cell_nbytes)
    if num_cells:
        _copy_cells_torch(dst, dst_ids, src, src_ids, num_cells, cell_nbytes, None)


def _check_cells(dst: torch.Tensor, dst_cells: BlockIds | None, src: torch.Tensor, src_cells: BlockIds | None,
                 cell_nbytes: int) -> tuple[torch.Tensor | None, torch.Tensor | None, int]:
    """(dst ids, src ids, number of cells): ids as 1-D int64 CPU tensors in range, or None for cell i."""
    for name, buffer in (("dst", dst), ("src", src)):
        if not isinstance(buffer, torch.Tensor) or buffer.dtype != torch.uint8 or buffer.dim() != 1 \
                or not buffer.is_contiguous():
            raise InvalidArgument(f"{name} must be a contiguous 1-D uint8 tensor")
    if dst.device != src.device:
        raise InvalidArgument(f"dst is on {dst.device}, src on {src.device}: one device")
    if isinstance(cell_nbytes, bool) or not isinstance(cell_nbytes, int) or cell_nbytes <= 0:
        raise InvalidArgument(f"cell_nbytes must be a positive integer, got {cell_nbytes!r}")
    if dst_cells is None and src_cells is None:
        raise InvalidArgument("dst_cells or src_cells must name the cells")
    dst_ids = None if dst_cells is None else \
        _check_block_ids(dst_cells, dst.numel() // cell_nbytes, unique=False, what="dst_cells")
    src_ids = None if src_cells is None else \
        _check_block_ids(src_cells, src.numel() // cell_nbytes, unique=False, what="src_cells")
    counts = {ids.numel() for ids in (dst_ids, src_ids) if ids is not None}
    if len(counts) != 1:
        raise InvalidArgument(f"dst_cells and src_cells differ in length: {sorted(counts)}")
    num_cells = counts.pop()
    for name, ids, buffer in (("dst", dst_ids, dst), ("src", src_ids, src)):
        if ids is None and num_cells * cell_nbytes > buffer.numel():
            raise InvalidArgument(f"{name} holds {buffer.numel()} bytes, not {num_cells} cells of {cell_nbytes}")
    if dst.data_ptr() < src.data_ptr() + src.numel() and src.data_ptr() < dst.data_ptr() + dst.numel():
        raise InvalidArgument("dst and src overlap")
    return dst_ids, src_ids, num_cells


def _as_cells(buffer: torch.Tensor, unit_nbytes: int, cell_nbytes: int) -> torch.Tensor:
    """`[whole cells, cell_nbytes / unit]` over `buffer`, in the integer dtype of `unit_nbytes` bytes."""
    dtype = dict(_UNIT_DTYPES)[unit_nbytes]
    num_cells = buffer.numel() // cell_nbytes
    return buffer[:num_cells * cell_nbytes].view(dtype).view(num_cells, cell_nbytes // unit_nbytes)


def _copy_cells_torch(dst: torch.Tensor, dst_ids: torch.Tensor | None, src: torch.Tensor,
                      src_ids: torch.Tensor | None, num_cells: int, cell_nbytes: int,
                      staging: torch.Tensor | None) -> None:
    """One index op where a side is contiguous, else index_select into `staging` and index_copy_."""
    alignment = math.gcd(cell_nbytes, dst.data_ptr(), src.data_ptr(), dst.untyped_storage().data_ptr(),
                         src.untyped_storage().data_ptr())
    unit_nbytes = next(n for n, _ in _UNIT_DTYPES if alignment % n == 0)
    dst_rows, src_rows = _as_cells(dst, unit_nbytes, cell_nbytes), _as_cells(src, unit_nbytes, cell_nbytes)
    if dst_ids is None:
        assert src_ids is not None
        torch.index_select(src_rows, 0, src_ids.to(src.device), out=dst_rows[:num_cells])
        return
    if src_ids is None:
        dst_rows.index_copy_(0, dst_ids.to(dst.device), src_rows[:num_cells])
        return
    if staging is None or staging.numel() < num_cells * cell_nbytes or staging.device != dst.device \
            or staging.data_ptr() % unit_nbytes:
        staging = torch.empty(num_cells * cell_nbytes, dtype=torch.uint8, device=dst.device)
    ids = torch.stack([dst_ids, src_ids]).to(dst.device)  # one copy of both where the device is not the CPU
    gathered = _as_cells(staging, unit_nbytes, cell_nbytes)[:num_cells]
    torch.index_select(src_rows, 0, ids[1], out=gathered)
    dst_rows.index_copy_(0, ids[0], gathered)


def _launch_cells_kernel(dst: torch.Tensor, dst_ids: torch.Tensor | None, src: torch.Tensor,
                         src_ids: torch.Tensor | None, num_cells: int, cell_nbytes: int) -> None:
    device = dst.device
    alignment = math.gcd(cell_nbytes, dst.data_ptr(), src.data_ptr())
    unit_bytes = min(16, alignment & -alignment)
    named = [ids for ids in (dst_ids, src_ids) if ids is not None]
    device_ids = torch.stack(named).to(device)  # one host-to-device copy of the ids
    pointers = iter(row.data_ptr() for row in device_ids)
    dst_ids_ptr = next(pointers) if dst_ids is not None else 0
    src_ids_ptr = next(pointers) if src_ids is not None else 0
    units_per_cell = cell_nbytes // unit_bytes
    grid = (min(num_cells, _MAX_GRID_X),
            max(1, min(_MAX_GRID_Y, math.ceil(units_per_cell / (4 * THREADS_PER_BLOCK)))))
    args = (np.uint64(dst.data_ptr()), np.uint64(dst_ids_ptr), np.uint64(src.data_ptr()), np.uint64(src_ids_ptr),
            np.int64(num_cells), np.int64(cell_nbytes), np.int32(unit_bytes))
    launch_kernel(load_kernel(KERNEL_SOURCE, CELLS_KERNEL), device, grid, (THREADS_PER_BLOCK,), args)


def _gather_torch(caches: list[torch.Tensor], ids: torch.Tensor, out: torch.Tensor) -> None:
    """Copies bytes (a uint8 view: the last dim grows by the element size), never values."""
    ids = ids.to(out.device)
    out_bytes = out.view(torch.uint8)
    for layer, cache in enumerate(caches):
        out_bytes[:, layer] = cache.view(torch.uint8)[:, ids].transpose(0, 1)


def _scatter_torch(blocks: torch.Tensor, caches: list[torch.Tensor], ids: torch.Tensor) -> None:
    ids = ids.to(blocks.device)
    block_bytes = blocks.view(torch.uint8)
    for layer, cache in enumerate(caches):
        cache.view(torch.uint8)[:, ids] = block_bytes[:, layer].transpose(0, 1)


def _launch_layout_kernel(kernel_name: str, caches: list[torch.Tensor], ids: torch.Tensor,
                          slots: torch.Tensor) -> None:
    device = slots.device
    num_blocks, num_layers = ids.numel(), len(caches)
    _, num_engine_blocks, block_size, num_kv_heads, head_dim = caches[0].shape
    chunk_bytes = block_size * num_kv_heads * head_dim * caches[0].dtype.itemsize
    pointers = [cache.data_ptr() for cache in caches]
    alignment = math.gcd(chunk_bytes, slots.data_ptr(), *pointers)
    unit_bytes = min(16, alignment & -alignment)  # largest power of two dividing all of them
    layer_ptrs = torch.tensor(pointers, dtype=torch.int64).to(device)  # uint64 bits
    device_ids = ids.to(device)
    num_chunks = num_blocks * num_layers * 2
    units_per_chunk = chunk_bytes // unit_bytes
    grid = (min(num_chunks, _MAX_GRID_X),
            max(1, min(_MAX_GRID_Y, math.ceil(units_per_chunk / (4 * THREADS_PER_BLOCK)))))
    args = (np.uint64(layer_ptrs.data_ptr()), np.uint64(device_ids.data_ptr()),
            np.uint64(slots.data_ptr()), np.int32(num_blocks), np.int32(num_layers),
            np.int64(num_engine_blocks), np.int64(chunk_bytes), np.int32(unit_bytes))
    launch_kernel(load_kernel(KERNEL_SOURCE, kernel_name), device, grid, (THREADS_PER_BLOCK,), args)
