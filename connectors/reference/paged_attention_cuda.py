"""The CUDA paged-attention kernel (kernels/paged_attention.cu) behind paged_attention.py.

`paged_attention` calls `paged_attention_cuda` when `uses_paged_kernel` says the kernel takes
the tensors: query and caches on CUDA, CuPy importable, query and caches of one dtype among
fp32, fp16 and bf16, head_dim <= 256. Everything else (CPU tensors, CUDA without CuPy, fp8
caches, mixed dtypes) runs the torch reference, `paged_attention_reference`, which the kernel
matches: same varlen batch, block tables, GQA, causal bottom-right alignment, fp32 softmax,
output in the query's dtype.

One launch for the whole batch on torch's current stream: grid (num_tokens, num_heads), one
CUDA block of THREADS_PER_BLOCK threads per (query token, head), each streaming over the keys of
its token's causal prefix through the block table (online softmax; memory does not grow with
the context). The caches are read in place through their block, row and head strides, so the
strided views `pool[:, layer, 0]` and `pool[:, layer, 1]` of the block-major pool need no copy;
only their last dim must be contiguous.

Every input is checked (InvalidArgument) before the launch, the metadata values included: an
out-of-range block id would be an illegal address that poisons the CUDA context. Reading those
values costs one device-to-host copy when the metadata lives on the GPU (the reference reads
them too); the kernel then gets int32 copies of exactly the values that were checked.
"""

from __future__ import annotations

import numpy as np
import torch

from kvtierd.connectors.reference.paged_kv_cache import check_cache_pair
from kvtierd.errors import InvalidArgument
from kvtierd.movers.cuda_kernels import launch_kernel, load_kernel, uses_cuda_kernel

KERNEL_SOURCE = "paged_attention.cu"
KERNELS = {torch.float32: "paged_attention_f32", torch.float16: "paged_attention_f16",
           torch.bfloat16: "paged_attention_bf16"}
# Every kernel name this module launches, by source file; tests check them in the compiled code.
KERNEL_NAMES: dict[str, tuple[str, ...]] = {KERNEL_SOURCE: tuple(KERNELS.values())}

THREADS_PER_BLOCK = 128  # 4 warps; the kernel takes any multiple of 32 up to 256
MAX_HEAD_DIM = 256  # 8 dims per lane (PA_MAX_HEAD_DIM in the kernel)
_MAX_GRID_Y = 65535  # grid.y is the query head
_INT32_MAX = 2**31 - 1
_INDEX_DTYPES = (torch.int32, torch.int64)


def uses_paged_kernel(query: torch.Tensor, key_cache: torch.Tensor) -> bool:
    """True when `paged_attention` should run the CUDA kernel on these tensors."""
    return (uses_cuda_kernel(query) and key_cache.is_cuda and query.dtype in KERNELS
            and key_cache.dtype == query.dtype and query.dim() == 3 and query.shape[2] <= MAX_HEAD_DIM)


def paged_attention_cuda(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                         block_tables: torch.Tensor, context_lens: torch.Tensor,
                         query_start_loc: torch.Tensor, scale: float) -> torch.Tensor:
    """`paged_attention_reference` as one kernel launch: `[num_tokens, num_heads, head_dim]`.

    query, key_cache and value_cache on one CUDA device, of one dtype (fp32, fp16 or bf16); the
    metadata (int32 or int64) on any device. Asynchronous on torch's current stream.
    """
    _check_tensors(query, key_cache, value_cache)
    num_tokens, num_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, _ = key_cache.shape
    tables, lens, starts = _check_metadata(block_tables, context_lens, query_start_loc, num_tokens,
                                           num_blocks, block_size)
    _check_devices(query, key_cache, value_cache)
    query = query.contiguous()
    out = torch.empty_like(query)
    if num_tokens == 0:
        return out
    device = query.device
    tables, lens, starts = (t.to(device) for t in (tables, lens, starts))
    block_stride, row_stride, head_stride, _ = key_cache.stride()
    args = (np.uint64(out.data_ptr()), np.uint64(query.data_ptr()), np.uint64(key_cache.data_ptr()),
            np.uint64(value_cache.data_ptr()), np.uint64(tables.data_ptr()),
            np.uint64(lens.data_ptr()), np.uint64(starts.data_ptr()), np.float32(scale),
            np.int32(lens.shape[0]), np.int32(num_heads), np.int32(num_kv_heads),
            np.int32(head_dim), np.int32(block_size), np.int32(tables.shape[1]),
            np.int64(block_stride), np.int64(row_stride), np.int64(head_stride))
    launch_kernel(load_kernel(KERNEL_SOURCE, KERNELS[query.dtype]), device, (num_tokens, num_heads),
                  (THREADS_PER_BLOCK,), args)
    return out


def _check_tensors(query, key_cache, value_cache) -> None:
    """Shapes, dtypes and strides of the query and the caches."""
    if not all(isinstance(t, torch.Tensor) for t in (query, key_cache, value_cache)):
        raise InvalidArgument("query, key_cache and value_cache must be torch tensors")
    check_cache_pair(key_cache, value_cache)
    if query.dim() != 3:
        raise InvalidArgument(f"query must be [num_tokens, num_heads, head_dim], got {tuple(query.shape)}")
    if query.dtype not in KERNELS or (key_cache.dtype, value_cache.dtype) != (query.dtype, query.dtype):
        raise InvalidArgument(f"query and caches must share one dtype of {list(KERNELS)}, got query "
                              f"{query.dtype}, caches {key_cache.dtype} and {value_cache.dtype}")
    num_heads, head_dim = query.shape[1:]
    block_size, num_kv_heads, cache_head_dim = key_cache.shape[1:]
    if not 1 <= head_dim <= MAX_HEAD_DIM or cache_head_dim != head_dim:
        raise InvalidArgument(f"head_dim must be in [1, {MAX_HEAD_DIM}] and equal in query and cache, got "
                              f"{head_dim} and {cache_head_dim}")
    if not 1 <= num_heads <= _MAX_GRID_Y or num_kv_heads == 0 or num_heads % num_kv_heads:
        raise InvalidArgument(f"{num_heads} query heads cannot read {num_kv_heads} KV heads (a multiple, "
                              f"at most {_MAX_GRID_Y})")
    if block_size == 0:
        raise InvalidArgument("block_size must be at least 1")
    if key_cache.stride() != value_cache.stride():
        raise InvalidArgument(f"key and value caches must have one set of strides, got {key_cache.stride()} "
                              f"and {value_cache.stride()}")
    if key_cache.stride(3) != 1 and head_dim > 1:
        raise InvalidArgument(f"the caches' last dim must be contiguous, got strides {key_cache.stride()}")


def _index_tensor(tensor, name: str, dim: int) -> torch.Tensor:
    """`tensor` as int64 on the CPU, after checking it is an int32/int64 tensor of `dim` dims."""
    if not isinstance(tensor, torch.Tensor) or tensor.dim() != dim or tensor.dtype not in _INDEX_DTYPES:
        raise InvalidArgument(f"{name} must be a {dim}-D int32/int64 tensor, got "
                              f"{tensor.dtype if isinstance(tensor, torch.Tensor) else type(tensor).__name__}"
                              f"{' ' + str(tuple(tensor.shape)) if isinstance(tensor, torch.Tensor) else ''}")
    return tensor.to("cpu", torch.int64)


def _check_metadata(block_tables, context_lens, query_start_loc, num_tokens: int, num_blocks: int,
                    block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The checked block tables, context lengths and query starts as contiguous int32 CPU tensors.

    Only the blocks a query reads are checked: a table entry past a sequence's context (padding,
    -1 in vLLM) and the tables of sequences without queries are never read.
    """
    lens = _index_tensor(context_lens, "context_lens", 1)
    starts = _index_tensor(query_start_loc, "query_start_loc", 1)
    tables = _index_tensor(block_tables, "block_tables", 2)
    num_seqs = lens.shape[0]
    if starts.shape[0] != num_seqs + 1 or tables.shape[0] != num_seqs:
        raise InvalidArgument(f"{num_seqs} context lengths need {num_seqs + 1} query starts and {num_seqs} "
                              f"block tables, got {starts.shape[0]} and {tables.shape[0]}")
    if num_tokens > _INT32_MAX:
        raise InvalidArgument(f"too many query tokens ({num_tokens})")
    num_queries = starts.diff()
    if int(starts[0]) != 0 or int(starts[-1]) != num_tokens or bool((num_queries < 0).any()):
        raise InvalidArgument(f"query_start_loc must rise from 0 to num_tokens ({num_tokens}), got "
                              f"{starts.tolist()}")
    if bool((lens > _INT32_MAX).any()) or bool((num_queries > lens).any()):
        bad = int(torch.nonzero((num_queries > lens) | (lens > _INT32_MAX))[0])
        raise InvalidArgument(f"sequence {bad} has {int(num_queries[bad])} queries but a context of "
                              f"{int(lens[bad])}")
    blocks_read = torch.where(num_queries > 0, (lens + block_size - 1) // block_size, 0)
    if num_seqs and int(blocks_read.max()) > tables.shape[1]:
        bad = int(blocks_read.argmax())
        raise InvalidArgument(f"sequence {bad} reads {int(blocks_read[bad])} blocks but block_tables has "
                              f"{tables.shape[1]} columns")
    read = torch.arange(tables.shape[1]) < blocks_read.unsqueeze(1)
    ids_read = tables[read]
    if ids_read.numel() and (int(ids_read.min()) < 0 or int(ids_read.max()) >= num_blocks):
        raise InvalidArgument(f"block ids must be in [0, {num_blocks}), got min {int(ids_read.min())} max "
                              f"{int(ids_read.max())}")
    # Unread entries may be anything: zero them so the int32 copy cannot overflow.
    tables = torch.where(read, tables, 0).to(torch.int32).contiguous()
    return tables, lens.to(torch.int32), starts.to(torch.int32)


def _check_devices(query, key_cache, value_cache) -> None:
    """query and caches on one CUDA device (the metadata is copied there)."""
    if not query.is_cuda or key_cache.device != query.device or value_cache.device != query.device:
        raise InvalidArgument(f"query and caches must be on one CUDA device, got {query.device}, "
                              f"{key_cache.device} and {value_cache.device}")
