"""Gather and scatter between an engine's per-layer KV caches and block-major slots.

An engine such as vLLM keeps one contiguous tensor per layer, `[2, num_engine_blocks,
block_size, num_kv_heads, head_dim]`; kvtierd stores a block as one contiguous slot,
`[num_layers, 2, block_size, num_kv_heads, head_dim]` (docs/architecture.md §3). `gather_blocks` packs
the per-layer pieces of the given engine blocks into slots, `scatter_blocks` writes them back:
    slots[i, layer, kv] == layer_caches[layer][kv, block_ids[i]]
Both move raw bytes, never values, so they are bit exact for every 1-, 2- or 4-byte dtype
(fp16, bf16, fp8 e4m3, fp32), and `scatter(gather(x))` restores x exactly.

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
# Every kernel name this module launches, by source file; tests check them in the compiled code.
KERNEL_NAMES: dict[str, tuple[str, ...]] = {KERNEL_SOURCE: (GATHER_KERNEL, SCATTER_KERNEL)}

THREADS_PER_BLOCK = 256
_MAX_GRID_X, _MAX_GRID_Y = 1 << 20, 65535  # the kernels grid-stride past these
BlockIds = Sequence[int] | torch.Tensor



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


def _check_block_ids(block_ids: BlockIds, num_engine_blocks: int, *, unique: bool) -> torch.Tensor:
    """Block ids as a 1-D int64 CPU tensor, each in [0, num_engine_blocks), unique if asked."""
    if isinstance(block_ids, torch.Tensor):
        if block_ids.dim() != 1 or block_ids.dtype not in (torch.int32, torch.int64):
            raise InvalidArgument(f"block_ids must be a 1-D int32/int64 tensor, got "
                                  f"{block_ids.dtype} {tuple(block_ids.shape)}")
        ids = block_ids.to("cpu", torch.int64)
    else:
        try:
            ids = torch.tensor([operator.index(b) for b in block_ids], dtype=torch.int64)
        except (TypeError, RuntimeError) as e:
            raise InvalidArgument(f"block_ids must be integers: {e}") from e
    if ids.numel() >= 2**31:
        raise InvalidArgument(f"too many block ids ({ids.numel()})")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_engine_blocks):
        raise InvalidArgument(f"block ids must be in [0, {num_engine_blocks}), got min "
                              f"{int(ids.min())} max {int(ids.max())}")
    if unique and torch.unique(ids).numel() != ids.numel():
        raise InvalidArgument("scatter block ids must be unique (two writes to one block)")
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
