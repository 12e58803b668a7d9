"""The CUDA paged-attention kernel matches paged_attention_reference (varlen batches, GQA, shuffled
block tables, strided pool views, any block size); the wrapper rejects bad input before a launch;
CPU tensors never reach the kernel."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch

from kvtierd.connectors.reference import paged_attention as paged_attention_module
from kvtierd.connectors.reference.paged_attention import paged_attention, paged_attention_reference
from kvtierd.connectors.reference.paged_attention_cuda import (
    KERNEL_NAMES,
    KERNEL_SOURCE,
    paged_attention_cuda,
    uses_paged_kernel,
)
from kvtierd.errors import InvalidArgument

NUM_LAYERS, LAYER = 3, 1  # the caches are views of layer 1 of a 3-layer block-major pool
# (atol, rtol) against the reference: both compute in fp32 and round once to the output dtype.
TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.float16: (1e-3, 2e-3), torch.bfloat16: (8e-3, 1.6e-2)}
# A mixed batch: a whole prefill, a prefill after a cached prefix, a decode, a sequence without
# queries, a one-token context. block_size 16 divides none of the context lengths.
MIXED_CONTEXT_LENS = (37, 50, 29, 16, 1)
MIXED_NUM_QUERIES = (37, 13, 1, 0, 1)


@dataclasses.dataclass
class PagedBatch:
    query: torch.Tensor
    pool: torch.Tensor  # [num_blocks, NUM_LAYERS, 2, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor  # unread entries are -1
    context_lens: torch.Tensor
    query_start_loc: torch.Tensor
    scale: float

    @property
    def key_cache(self) -> torch.Tensor:
        return self.pool[:, LAYER, 0]

    @property
    def value_cache(self) -> torch.Tensor:
        return self.pool[:, LAYER, 1]

    def args(self) -> tuple:
        return (self.query, self.key_cache, self.value_cache, self.block_tables, self.context_lens,
                self.query_start_loc, self.scale)

    def to(self, device) -> PagedBatch:
        return PagedBatch(self.query.to(device), self.pool.to(device), self.block_tables.to(device),
                          self.context_lens.to(device), self.query_start_loc.to(device), self.scale)


def make_batch(context_lens=MIXED_CONTEXT_LENS, num_queries=MIXED_NUM_QUERIES, *, num_heads=8,
               num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32, seed=0,
               num_spare_blocks=3) -> PagedBatch:
    """A random batch on the CPU whose sequences own shuffled, non-consecutive blocks of a pool.

    The pool is random everywhere (spare blocks and the other layer's K/V included), so reading a
    wrong block, row, head or layer changes the result. Queries are scaled by 2 for peaked softmaxes.
    """
    generator = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-length // block_size) for length in context_lens]
    num_blocks = sum(blocks_per_seq) + num_spare_blocks
    pool = torch.randn(num_blocks, NUM_LAYERS, 2, block_size, num_kv_heads, head_dim,
                       generator=generator).to(dtype)
    block_ids = torch.randperm(num_blocks, generator=generator)
    block_tables = torch.full((len(context_lens), max(blocks_per_seq) + 1), -1, dtype=torch.int32)
    taken = 0
    for seq, count in enumerate(blocks_per_seq):
        block_tables[seq, :count] = block_ids[taken:taken + count].to(torch.int32)
        taken += count
    query_start_loc = torch.tensor([0, *itertools.accumulate(num_queries)], dtype=torch.int32)
    query = (2 * torch.randn(int(query_start_loc[-1]), num_heads, head_dim, generator=generator)).to(dtype)
    return PagedBatch(query, pool, block_tables, torch.tensor(context_lens, dtype=torch.int32),
                      query_start_loc, 1.0 / math.sqrt(head_dim))


def naive_attention(batch: PagedBatch) -> torch.Tensor:
    """Float64, one (token, head) at a time, straight from the definition in paged_attention.py."""
    num_tokens, num_heads, head_dim = batch.query.shape
    group = num_heads // batch.key_cache.shape[2]
    block_size = batch.key_cache.shape[1]
    out = torch.zeros(num_tokens, num_heads, head_dim, dtype=torch.float64)
    starts = batch.query_start_loc.tolist()
    for seq, context_len in enumerate(batch.context_lens.tolist()):
        num_queries = starts[seq + 1] - starts[seq]
        for i in range(num_queries):
            position = context_len - num_queries + i
            slots = [(int(batch.block_tables[seq, key // block_size]), key % block_size)
                     for key in range(position + 1)]
            for head in range(num_heads):
                keys = torch.stack([batch.key_cache[b, r, head // group] for b, r in slots]).double()
                values = torch.stack([batch.value_cache[b, r, head // group] for b, r in slots]).double()
                weights = torch.softmax(keys @ batch.query[starts[seq] + i, head].double() * batch.scale, 0)
                out[starts[seq] + i, head] = weights @ values
    return out


def reference_on_cpu(batch: PagedBatch) -> torch.Tensor:
    """The torch reference, run on CPU copies (its causal mask is built on the CPU)."""
    return paged_attention_reference(*batch.to("cpu").args())


def assert_close_to_reference(out: torch.Tensor, batch: PagedBatch) -> None:
    expected = reference_on_cpu(batch)
    assert out.shape == expected.shape and out.dtype == expected.dtype
    atol, rtol = TOLERANCES[out.dtype]
    torch.testing.assert_close(out.cpu().float(), expected.float(), atol=atol, rtol=rtol)


# --- CPU: the reference's semantics, the fallback, validation ------------------------------

def test_reference_matches_naive_attention_on_strided_shuffled_cache():
    """The semantics the kernel is tested against: causal bottom-right, GQA, block tables, strides."""
    batch = make_batch(num_heads=4, num_kv_heads=2, head_dim=8, block_size=5)
    assert not batch.key_cache.is_contiguous()
    expected = naive_attention(batch)
    torch.testing.assert_close(reference_on_cpu(batch).double(), expected, atol=1e-5, rtol=1e-5)


def test_uses_paged_kernel_is_false_for_cpu_tensors():
    batch = make_batch()
    assert not uses_paged_kernel(batch.query, batch.key_cache)


def test_paged_attention_on_cpu_runs_the_reference(monkeypatch):
    """CPU tensors never reach the CUDA wrapper; the result is the reference's, bit for bit."""
    def no_kernel(*args):
        raise AssertionError("paged_attention_cuda called for CPU tensors")

    monkeypatch.setattr("kvtierd.connectors.reference.paged_attention_cuda.paged_attention_cuda", no_kernel)
    batch = make_batch(dtype=torch.float16)
    assert torch.equal(paged_attention(*batch.args()), reference_on_cpu(batch))


def test_kernel_names_cover_each_dtype():
    assert KERNEL_NAMES == {KERNEL_SOURCE: ("paged_attention_f32", "paged_attention_f16", "paged_attention_bf16")}


def test_valid_cpu_batch_passes_every_check_but_the_device():
    """The checks accept -1 padding and sequences without queries; only the CPU device fails."""
    with pytest.raises(InvalidArgument, match="one CUDA device"):
        paged_attention_cuda(*make_batch().args())


def _with(batch: PagedBatch, **changes) -> tuple:
    """batch.args() with some replaced by name."""
    names = ("query", "key_cache", "value_cache", "block_tables", "context_lens", "query_start_loc", "scale")
    values = dict(zip(names, batch.args()))
    values.update(changes)
    return tuple(values[name] for name in names)


def _bad_block_id(batch, value, seq=1, column=2):
    tables = batch.block_tables.clone()
    tables[seq, column] = value
    return _with(batch, block_tables=tables)


BAD_INPUTS = {
    "mixed dtypes": (lambda b: _with(b, query=b.query.half()), "one dtype"),
    "float64": (lambda b: _with(b, query=b.query.double(), key_cache=b.key_cache.double(),
                                value_cache=b.value_cache.double()), "one dtype"),
    "head_dim over 256": (lambda b: _with(b, query=torch.zeros(87, 8, 320),
                                          key_cache=torch.zeros(4, 16, 2, 320),
                                          value_cache=torch.zeros(4, 16, 2, 320)), "head_dim"),
    "heads not a multiple": (lambda b: _with(b, query=b.query[:, :7]), "query heads"),
    "query not 3-D": (lambda b: _with(b, query=b.query[0]), "num_tokens, num_heads"),
    "last dim strided": (lambda b: _with(b, key_cache=b.pool[..., ::2][:, LAYER, 0],
                                         value_cache=b.pool[..., ::2][:, LAYER, 1],
                                         query=b.query[..., ::2]), "contiguous"),
    "key and value strides differ": (lambda b: _with(b, value_cache=b.value_cache.contiguous()), "strides"),
    "block id past the pool": (lambda b: _bad_block_id(b, b.pool.shape[0]), "block ids"),
    "negative block id read": (lambda b: _bad_block_id(b, -1), "block ids"),
    "table too narrow": (lambda b: _with(b, block_tables=b.block_tables[:, :2]), "columns"),
    "more queries than context": (lambda b: _with(b, context_lens=torch.tensor([36, 50, 29, 16, 1])),
                                  "sequence 0 has 37 queries but a context of 36"),
    "starts not ending at num_tokens": (lambda b: _with(b, query=b.query[:-1]), "query_start_loc"),
    "starts decreasing": (lambda b: _with(b, query_start_loc=torch.tensor([0, 50, 37, 51, 51, 52])),
                          "query_start_loc"),
    "too few starts": (lambda b: _with(b, query_start_loc=b.query_start_loc[:-1]), "query starts"),
    "float block tables": (lambda b: _with(b, block_tables=b.block_tables.float()), "int32/int64"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_raises_invalid_argument(case):
    make_args, message = BAD_INPUTS[case]
    with pytest.raises(InvalidArgument, match=message):
        paged_attention_cuda(*make_args(make_batch()))


def test_unread_table_entries_and_sequences_without_queries_are_not_checked():
    """Garbage where no query reads (past a context, or a sequence without queries) is allowed."""
    batch = make_batch()
    tables = batch.block_tables.clone()
    tables[3] = 10**6  # sequence 3 has no queries
    tables[0, -1] = -7  # past sequence 0's context
    with pytest.raises(InvalidArgument, match="one CUDA device"):
        paged_attention_cuda(*_with(batch, block_tables=tables))


# --- GPU: the kernel against the reference -------------------------------------------------

@pytest.fixture
def cupy_kernels():
    pytest.importorskip("cupy", reason="the CUDA kernel needs CuPy")


def run_kernel(batch: PagedBatch) -> torch.Tensor:
    """The kernel on `batch` (already on CUDA), checking it leaves the pool untouched."""
    pool_before = batch.pool.clone()
    out = paged_attention_cuda(*batch.args())
    torch.cuda.synchronize()
    assert torch.equal(batch.pool, pool_before)
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", list(TOLERANCES), ids=str)
@pytest.mark.parametrize("head_dim", [64, 80, 128, 256])
def test_kernel_matches_reference_on_mixed_batch(cupy_kernels, dtype, head_dim):
    """Prefill, prefill after a cached prefix, decode and an empty sequence in one launch, GQA 8:2."""
    batch = make_batch(head_dim=head_dim, dtype=dtype, seed=head_dim).to("cuda")
    assert uses_paged_kernel(batch.query, batch.key_cache)
    assert_close_to_reference(run_kernel(batch), batch)


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [1, 5, 32])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 1), (6, 3)])
def test_kernel_matches_reference_for_any_block_size_and_grouping(cupy_kernels, block_size, num_heads,
                                                                  num_kv_heads):
    """MHA, MQA and GQA; block sizes 1, 5 and 32 (5 and 32 divide no context length here)."""
    batch = make_batch((9, 23, 70), (3, 2, 1), num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=40,
                       block_size=block_size, seed=block_size).to("cuda")
    assert_close_to_reference(run_kernel(batch), batch)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", list(TOLERANCES), ids=str)
def test_kernel_matches_reference_on_pure_decode_with_long_contexts(cupy_kernels, dtype):
    """One query per sequence, contexts from 1 to 2049 keys (hundreds of keys per warp)."""
    context_lens = (1, 17, 300, 1025, 2049)
    batch = make_batch(context_lens, (1,) * len(context_lens), head_dim=128, dtype=dtype, seed=7).to("cuda")
    assert_close_to_reference(run_kernel(batch), batch)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16), ids=str)
def test_kernel_matches_reference_at_llama3_8b_size(cupy_kernels, dtype):
    """Real sizes, Llama-3-8B's attention (32 heads / 8 KV heads of 128, block 16): four decodes at
    4,096 keys and a 512-token prefill after a 3,584-token cached prefix, in one launch."""
    batch = make_batch((4096,) * 5, (1, 1, 1, 1, 512), num_heads=32, num_kv_heads=8, head_dim=128,
                       dtype=dtype, seed=11).to("cuda")
    assert_close_to_reference(run_kernel(batch), batch)


@pytest.mark.gpu
def test_paged_attention_dispatches_to_the_kernel_on_cuda(cupy_kernels, monkeypatch):
    """On CUDA with CuPy, paged_attention never runs the torch reference and equals the kernel."""
    batch = make_batch(dtype=torch.bfloat16).to("cuda")
    expected = reference_on_cpu(batch)

    def no_reference(*args):
        raise AssertionError("the torch reference ran for CUDA tensors")

    monkeypatch.setattr(paged_attention_module, "paged_attention_reference", no_reference)
    out = paged_attention(batch.query, batch.key_cache, batch.value_cache, batch.block_tables,
                          batch.context_lens, batch.query_start_loc)  # the default scale, 1/sqrt(64)
    assert torch.equal(out, paged_attention_cuda(*batch.args()))
    atol, rtol = TOLERANCES[torch.bfloat16]
    torch.testing.assert_close(out.cpu().float(), expected.float(), atol=atol, rtol=rtol)


@pytest.mark.gpu
def test_kernel_takes_int64_metadata_on_either_device_and_a_strided_query(cupy_kernels):
    """A query sliced from a fused qkv tensor; metadata int64 on the GPU or int32 on the CPU."""
    batch = make_batch(dtype=torch.float16, seed=3).to("cuda")
    qkv = torch.randn(batch.query.shape[0], 3, *batch.query.shape[1:], device="cuda").half()
    qkv[:, 0] = batch.query
    strided = dataclasses.replace(batch, query=qkv[:, 0], block_tables=batch.block_tables.long(),
                                  context_lens=batch.context_lens.long(),
                                  query_start_loc=batch.query_start_loc.long())
    assert not strided.query.is_contiguous()
    on_cpu = dataclasses.replace(batch, block_tables=batch.block_tables.cpu(),
                                 context_lens=batch.context_lens.cpu(),
                                 query_start_loc=batch.query_start_loc.cpu())
    out = run_kernel(batch)
    assert torch.equal(run_kernel(strided), out)
    assert torch.equal(run_kernel(on_cpu), out)
    assert_close_to_reference(out, batch)


@pytest.mark.gpu
def test_kernel_with_no_query_tokens_returns_an_empty_output(cupy_kernels):
    batch = make_batch((5, 9), (0, 0)).to("cuda")
    out = paged_attention_cuda(*batch.args())
    assert out.shape == (0, 8, 64) and out.is_cuda
