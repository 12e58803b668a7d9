"""`sgl_kernel.kvcacheio` of kvtierd's CPU stand-in (see the package docstring): the HiCache copy between
the device KV pool and the host pool that hicache_io_backend="direct" with hicache_mem_layout="layer_first"
uses. Every other name raises NotImplementedError when called."""

from __future__ import annotations

import torch

from sgl_kernel import _unimplemented


def transfer_kv_direct(src_layers: list[torch.Tensor], dst_layers: list[torch.Tensor], src_indices: torch.Tensor,
                       dst_indices: torch.Tensor, page_size: int) -> None:
    """dst_layers[j][dst_indices] = src_layers[j][src_indices] for every j: token rows (the indices are
    token slots, whole pages of page_size tokens; the copy does not need to know the page size)."""
    del page_size
    if len(src_layers) != len(dst_layers):
        raise ValueError(f"transfer_kv_direct: {len(src_layers)} source layers, {len(dst_layers)} destination layers")
    if src_indices.numel() != dst_indices.numel():
        raise ValueError(f"transfer_kv_direct: {src_indices.numel()} source rows, {dst_indices.numel()} destination")
    if src_indices.numel() == 0:
        return
    for src, dst in zip(src_layers, dst_layers):
        src_rows = src_indices.to(device=src.device, dtype=torch.int64)
        dst_rows = dst_indices.to(device=dst.device, dtype=torch.int64)
        dst[dst_rows] = src[src_rows].to(dst.device)


def __getattr__(name: str):
    if name.startswith("_"):
        raise AttributeError(name)
    return _unimplemented(f"kvcacheio.{name}")
