"""The CUDA paged-attention kernel (kernels/paged_attention.cu) behind paged_attention.py.

Placeholder until the kernel lands: every tensor runs the torch reference.
"""

from __future__ import annotations

import torch


def uses_paged_kernel(query: torch.Tensor, key_cache: torch.Tensor) -> bool:
    return False


def paged_attention_cuda(query, key_cache, value_cache, block_tables, context_lens, query_start_loc,
                         scale: float) -> torch.Tensor:
    raise NotImplementedError
