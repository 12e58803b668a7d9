"""A CPU stand-in for SGLang's `sgl_kernel` package, for scripts/install-sglang-cpu's venv only.

Why: SGLang's CPU path imports `sgl_kernel` unconditionally (srt/mem_cache/allocation.py,
kernels/ops/kvcache/cache_move.py, the HiCache host pools), but no CPU build of it is published
(`sglang-kernel` / `sgl-kernel` on PyPI are CUDA builds; SGLang's own CPU kernels are a source build
for Intel AMX, which this machine lacks, so SGLang would use its torch-native layers anyway).

What: the few functions SGLang calls on the path kvtierd exercises (device="cpu",
attention_backend="torch_native", HiCache with hicache_io_backend="direct" and
hicache_mem_layout="layer_first"), written with plain torch index ops; they are correct, not fast.
Any other name resolves to a function that raises NotImplementedError when called, naming itself,
so that an import SGLang makes "just in case" does not fail but a real use is loud.

The venv finds this package through a .pth file in its site-packages that names scripts/sglang_cpu
(written by scripts/install-sglang-cpu); nothing else should import it.
"""

from __future__ import annotations

import ctypes

import torch

__version__ = "0.0.0+kvtierd.cpu.stub"


def assign_req_to_token_pool_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                 start_offset: torch.Tensor, end_offset: torch.Tensor,
                                 out_cache_loc: torch.Tensor, pool_len: int) -> None:
    """req_to_token[req_pool_indices[i], start_offset[i]:end_offset[i]] = the i-th run of out_cache_loc
    (the runs lie back to back in out_cache_loc), as SGLang's Triton kernel `assign_req_to_token_pool`."""
    del pool_len  # the row length: req_to_token's own shape says it
    starts = start_offset.tolist()
    ends = end_offset.tolist()
    rows = req_pool_indices.tolist()
    taken = 0
    for row, start, end in zip(rows, starts, ends):
        req_to_token[row, start:end] = out_cache_loc[taken:taken + end - start].to(req_to_token.dtype)
        taken += end - start


def _rows_at(address: int, stride: int, num_rows: int) -> torch.Tensor:
    """A (num_rows, stride) uint8 view of the memory at a raw address (a tensor's data_ptr())."""
    buffer = (ctypes.c_uint8 * (num_rows * stride)).from_address(address)
    return torch.frombuffer(buffer, dtype=torch.uint8).view(num_rows, stride)


def copy_all_layer_kv_cache_cpu(data_ptrs: torch.Tensor, strides: torch.Tensor, tgt_loc: torch.Tensor,
                                src_loc: torch.Tensor) -> None:
    """For each buffer (data_ptrs[b], a row of strides[b] bytes): row tgt_loc[i] = row src_loc[i], as
    SGLang's Triton kernel `copy_all_layer_kv_cache_tiled` (every source row is read before any row is
    written, so an overlapping move is safe)."""
    if tgt_loc.numel() == 0:
        return
    tgt = tgt_loc.to(torch.int64)
    src = src_loc.to(torch.int64)
    num_rows = int(max(tgt.max().item(), src.max().item())) + 1
    for address, stride in zip(data_ptrs.tolist(), strides.tolist()):
        rows = _rows_at(int(address), int(stride), num_rows)
        rows[tgt] = rows[src].clone()


def _unimplemented(name: str):
    def fail(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name} is not in kvtierd's CPU stand-in (scripts/sglang_cpu/sgl_kernel): SGLang called it "
            "on a path this venv does not support; add it there with torch ops if it is needed")
    fail.__name__ = name
    return fail


def __getattr__(name: str):
    # `from sgl_kernel import X` of a name not defined here: a function that raises when called.
    # Dunder and private names stay AttributeError, so that hasattr() probes and copy/pickle behave.
    if name.startswith("_"):
        raise AttributeError(name)
    return _unimplemented(name)
