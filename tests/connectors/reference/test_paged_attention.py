"""Paged attention through SDPA over grouped, gathered blocks equals the per-sequence fp32 reference
(and the float64 definition): varlen mixes of prefill, prefill after a cached prefix and decode,
MHA / GQA / MQA, contexts ending mid-block, any block size, fp32 and bf16; one SDPA call per
group, never one per sequence; bad input is refused before anything is read. On CUDA (gpu
marker): the same results, and bf16 runs on the flash and memory-efficient kernels only."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from kvtierd.connectors.reference.paged_attention import (
    as_wide_words,
    gather_keys,
    paged_attention,
    paged_attention_varlen,
)
from kvtierd.connectors.reference.paged_attention_metadata import PagedAttentionMetadata
from kvtierd.connectors.reference.paged_attention_triton import num_splits, uses_triton_decode
from kvtierd.errors import InvalidArgument
from tests.connectors.reference.paged_batches import LAYER, make_batch, naive_attention, per_sequence_reference

# (atol, rtol) against the fp32 reference: SDPA accumulates in fp32 and rounds once to the
# output's dtype, but its inputs (q·k products) stay in the query's dtype.
TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 4e-3), torch.bfloat16: (2e-2, 1.6e-2)}
GROUPINGS = [(4, 4), (4, 1), (8, 2), (6, 3)]  # (query heads, KV heads): MHA, MQA, GQA


def assert_close_to_reference(out: torch.Tensor, batch) -> None:
    expected = per_sequence_reference(batch)
    assert out.shape == expected.shape and out.dtype == expected.dtype
    atol, rtol = TOLERANCES[out.dtype]
    torch.testing.assert_close(out.cpu().float(), expected.float(), atol=atol, rtol=rtol)


@pytest.fixture
def sdpa_calls(monkeypatch) -> list[dict]:
    """Every scaled_dot_product_attention call from here on: its query shape and mask."""
    calls, sdpa = [], F.scaled_dot_product_attention

    def counted(query, key, value, **kwargs):
        calls.append(dict(query_shape=tuple(query.shape), key_shape=tuple(key.shape), **kwargs))
        return sdpa(query, key, value, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", counted)
    return calls


# --- the oracles agree -----------------------------------------------------------------------

def test_reference_and_sdpa_path_match_naive_attention_on_strided_shuffled_cache():
    """Both implementations equal the float64 definition: causal bottom-right, GQA, block tables, strides."""
    batch = make_batch(num_heads=4, num_kv_heads=2, head_dim=8, block_size=5)
    assert not batch.key_cache.is_contiguous()
    expected = naive_attention(batch)
    torch.testing.assert_close(per_sequence_reference(batch).double(), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(paged_attention_varlen(*batch.args()).double(), expected, atol=1e-5, rtol=1e-5)


# --- CPU: the SDPA path against the reference ------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("num_heads,num_kv_heads", GROUPINGS)
@pytest.mark.parametrize("block_size", [1, 5, 16])
def test_mixed_batch_matches_reference(dtype, num_heads, num_kv_heads, block_size):
    """Prefill, prefill after a cached prefix, decode, a sequence without queries and a one-token
    context in one call; contexts end mid-block for block sizes 5 and 16."""
    batch = make_batch(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=32, block_size=block_size,
                       dtype=dtype, seed=block_size)
    assert_close_to_reference(paged_attention_varlen(*batch.args()), batch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_decode_batch_with_unequal_contexts_is_one_masked_call(dtype, sdpa_calls):
    """Eight decodes of 1 to 300 keys: one gather per cache, one SDPA call with the padding
    masked, the query heads of each KV head packed as rows (no GQA inside SDPA)."""
    context_lens = (1, 17, 33, 48, 100, 129, 250, 300)
    batch = make_batch(context_lens, (1,) * 8, dtype=dtype, seed=3)
    out = paged_attention_varlen(*batch.args())
    call, = sdpa_calls
    assert call["query_shape"] == (8, 2, 4, 64) and call["key_shape"] == (8, 2, 300, 64)
    assert call["attn_mask"].shape == (8, 1, 1, 300) and call["attn_mask"].sum().item() == sum(context_lens)
    assert_close_to_reference(out, batch)


def test_decode_batch_with_equal_contexts_needs_no_mask(sdpa_calls):
    """Equal contexts ending mid-block: the keys are cut to the context, nothing is masked."""
    batch = make_batch((45,) * 6, (1,) * 6, seed=4)
    out = paged_attention_varlen(*batch.args())
    call, = sdpa_calls
    assert call["attn_mask"] is None and call["key_shape"] == (6, 2, 45, 64)
    assert_close_to_reference(out, batch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_equal_prefills_and_decodes_take_one_call_per_group(dtype, sdpa_calls):
    """Three whole prefills of 40 tokens (one causal call), two suffixes of 7 queries after
    cached prefixes of different lengths (one masked call), four decodes (one masked call)."""
    context_lens = (40, 60, 40, 9, 40, 12, 70, 7, 23)
    num_queries = (40, 1, 40, 7, 40, 1, 7, 1, 1)
    batch = make_batch(context_lens, num_queries, dtype=dtype, seed=5)
    out = paged_attention_varlen(*batch.args())
    shapes = sorted((c["query_shape"], c.get("is_causal", False)) for c in sdpa_calls)
    assert shapes == [((2, 2, 28, 64), False), ((3, 8, 40, 64), True), ((4, 2, 4, 64), False)]
    assert_close_to_reference(out, batch)


def test_a_suffix_mask_is_bottom_right_causal_per_packed_row():
    """7 queries after a cached prefix, GQA 8:2: packed row r is query r // 4; it sees keys up to
    context - 7 + r // 4, and the shorter sequence's padding never."""
    metadata = PagedAttentionMetadata.build([[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]], [70, 12], [0, 7, 14], 16)
    group, = metadata.groups
    mask = group.key_mask(4)
    assert mask.shape == (2, 1, 28, 70)
    assert mask[0, 0].sum(dim=1).tolist() == [64 + r // 4 for r in range(28)]
    assert mask[1, 0].sum(dim=1).tolist() == [6 + r // 4 for r in range(28)]
    assert group.key_mask(4) is mask  # built once, reused by every layer


def test_rows_of_a_group_that_are_not_consecutive_are_gathered_and_scattered_back():
    """Decodes between two prefills: the decode group's rows are an index, the output lands in place."""
    batch = make_batch((30, 20, 30, 25), (30, 1, 30, 1), seed=6)
    metadata = PagedAttentionMetadata.build(batch.block_tables, batch.context_lens, batch.query_start_loc, 16)
    causal, decode = metadata.groups
    assert causal.token_rows.tolist() == [*range(30), *range(31, 61)]
    assert decode.token_rows.tolist() == [30, 61]
    assert_close_to_reference(paged_attention(batch.query, batch.key_cache, batch.value_cache, metadata,
                                              batch.scale), batch)


def test_a_query_sliced_from_a_fused_projection_gives_the_same_result():
    """The model passes q as a strided view of its qkv output."""
    batch = make_batch(seed=7)
    fused = torch.randn(batch.query.shape[0], 12, 64)
    fused[:, :8] = batch.query
    strided = dataclasses.replace(batch, query=fused[:, :8])
    assert not strided.query.is_contiguous()
    assert torch.equal(paged_attention_varlen(*strided.args()), paged_attention_varlen(*batch.args()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_gather_reads_keys_and_values_as_wide_words_bit_for_bit(dtype):
    """The 8-byte view of a strided cache gathers the same bits as index_select of the cache."""
    batch = make_batch(dtype=dtype, seed=8)
    metadata = PagedAttentionMetadata.build(batch.block_tables, batch.context_lens, batch.query_start_loc, 16)
    for cache in (batch.key_cache, batch.value_cache):
        assert as_wide_words(cache).dtype == torch.int64
        for group in metadata.groups:
            blocks = cache.index_select(0, group.block_ids)
            expected = blocks.view(group.num_seqs, -1, *cache.shape[2:])[:, :group.num_keys].transpose(1, 2)
            assert torch.equal(gather_keys(cache, group, 0), expected)


def test_layers_reuse_the_gather_buffers_and_their_outputs_stay_their_own():
    """Two layers through one metadata: the second gathers into the first's buffers, and the
    first layer's output (returned before) is still its own."""
    batch = make_batch(seed=16)
    metadata = PagedAttentionMetadata.build(batch.block_tables, batch.context_lens, batch.query_start_loc, 16)
    layer_0 = dataclasses.replace(batch, pool=batch.pool.roll(1, dims=1))  # layer 1's K/V become another's
    out_0 = paged_attention(layer_0.query, layer_0.key_cache, layer_0.value_cache, metadata, batch.scale)
    def buffers() -> dict:
        return {(i, key): buffer.data_ptr() for i, group in enumerate(metadata.groups)
                for key, buffer in group._gather_buffers.items()}

    first = buffers()
    out_1 = paged_attention(batch.query, batch.key_cache, batch.value_cache, metadata, batch.scale)
    assert buffers() == first and len(first) == 2 * len(metadata.groups)
    assert_close_to_reference(out_0, layer_0)
    assert_close_to_reference(out_1, batch)
    assert not torch.equal(out_0, out_1)


def test_a_cache_whose_rows_are_not_whole_words_is_gathered_as_is():
    odd = torch.zeros(4, 2, 1, 3, dtype=torch.bfloat16)  # 6-byte rows
    assert as_wide_words(odd) is odd
    assert as_wide_words(torch.zeros(4, 2, 1, 8, dtype=torch.float64)).dtype == torch.float64


def test_metadata_from_lists_equals_metadata_from_tensors():
    batch = make_batch(seed=9)
    from_tensors = PagedAttentionMetadata.build(batch.block_tables, batch.context_lens, batch.query_start_loc, 16)
    from_lists = PagedAttentionMetadata.build(batch.block_tables.tolist(), batch.context_lens.tolist(),
                                              batch.query_start_loc.tolist(), 16)
    assert (from_tensors.num_tokens, from_tensors.max_block_id) == (from_lists.num_tokens, from_lists.max_block_id)
    for a, b in zip(from_tensors.groups, from_lists.groups, strict=True):
        assert torch.equal(a.block_ids, b.block_ids) and a.token_rows == b.token_rows


def test_no_query_tokens_give_an_empty_output():
    batch = make_batch((5, 9), (0, 0))
    out = paged_attention_varlen(*batch.args())
    assert out.shape == (0, 8, 64)


def test_decode_splits_fill_the_device_and_stay_long():
    """Off CUDA the device counts 4 SMs: 2 programs each, splits of at least 256 keys."""
    cpu = torch.device("cpu")
    assert num_splits(1, 2, 1000, cpu) == 4
    assert num_splits(1, 2, 300, cpu) == 2
    assert num_splits(8, 2, 5000, cpu) == 1


def test_cpu_tensors_never_take_the_triton_kernel():
    batch = make_batch(dtype=torch.bfloat16)
    assert not uses_triton_decode(batch.query, batch.key_cache, batch.value_cache)


TRITON_INTERPRETER_CHECK = """
import torch
from kvtierd.connectors.reference import paged_attention as module
from kvtierd.connectors.reference.paged_attention import paged_attention_varlen
from tests.connectors.reference.paged_batches import make_batch, per_sequence_reference
launches = []
kernel = module.paged_decode_triton
module.paged_decode_triton = lambda *args: launches.append(args[3].num_seqs) or kernel(*args)
for lens, head_dim, block_size, heads in [((1000,), 64, 16, (8, 2)), ((1, 1000), 80, 5, (6, 3)),
                                          ((257, 513, 1000, 3), 32, 32, (4, 1)), ((65, 64, 63), 128, 1, (4, 4))]:
    batch = make_batch(lens, (1,) * len(lens), num_heads=heads[0], num_kv_heads=heads[1], head_dim=head_dim,
                       block_size=block_size, dtype=torch.float16, seed=head_dim)
    torch.testing.assert_close(paged_attention_varlen(*batch.args()).float(),
                               per_sequence_reference(batch).float(), atol=2e-3, rtol=4e-3)
assert launches == [1, 2, 4, 3], launches
print("ok")
"""


@pytest.mark.slow  # the interpreter runs the kernel in numpy: ~30 s
def test_triton_decode_kernel_in_the_interpreter_matches_reference():
    """Where Triton is installed, its interpreter runs the decode kernel on CPU tensors: splits,
    empty splits past a short context, head_dim 80, block sizes 1 to 32, MHA / GQA / MQA. fp16 only:
    the interpreter does not emulate bf16 tl.dot (the gpu tests cover bf16)."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", TRITON_INTERPRETER_CHECK], capture_output=True, text=True,
                          env=env, timeout=600, cwd=os.path.dirname(os.path.dirname(os.path.dirname(
                              os.path.dirname(os.path.abspath(__file__))))))
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stdout + done.stderr


# --- bad input ---------------------------------------------------------------------------------

def _with(batch, **changes) -> tuple:
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
    "heads not a multiple": (lambda b: _with(b, query=b.query[:, :7]), "query heads"),
    "head_dim differs": (lambda b: _with(b, query=b.query[..., :32]), "query heads of 32"),
    "query not 3-D": (lambda b: _with(b, query=b.query[0]), "num_tokens, num_heads"),
    "caches differ": (lambda b: _with(b, value_cache=b.value_cache[:, :4]), "one shape"),
    "block id past the pool": (lambda b: _bad_block_id(b, b.pool.shape[0]), "block ids must be in"),
    "negative block id read": (lambda b: _bad_block_id(b, -1), "not be negative"),
    "table too narrow": (lambda b: _with(b, block_tables=b.block_tables[:, :2]), "columns"),
    "more queries than context": (lambda b: _with(b, context_lens=torch.tensor([36, 50, 29, 16, 1])),
                                  "sequence 0 has 37 queries but a context of 36"),
    "starts not ending at num_tokens": (lambda b: _with(b, query=b.query[:-1]), "describes 52 query tokens"),
    "starts decreasing": (lambda b: _with(b, query_start_loc=torch.tensor([0, 50, 37, 51, 51, 52])),
                          "query_start_loc"),
    "too few starts": (lambda b: _with(b, query_start_loc=b.query_start_loc[:-1]), "query starts"),
    "float block tables": (lambda b: _with(b, block_tables=b.block_tables.float()), "int32/int64"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_raises_invalid_argument(case):
    make_args, message = BAD_INPUTS[case]
    with pytest.raises(InvalidArgument, match=message):
        paged_attention_varlen(*make_args(make_batch()))


def test_metadata_for_another_block_size_is_refused():
    batch = make_batch()
    metadata = PagedAttentionMetadata.build(batch.block_tables, batch.context_lens, batch.query_start_loc, 32)
    with pytest.raises(InvalidArgument, match="blocks of 32"):
        paged_attention(batch.query, batch.key_cache, batch.value_cache, metadata)


def test_unread_table_entries_and_sequences_without_queries_are_not_checked():
    """Garbage where no query reads (past a context, or a sequence without queries) is allowed."""
    batch = make_batch()
    tables = batch.block_tables.clone()
    tables[3] = 10**6  # sequence 3 has no queries
    tables[0, -1] = -7  # past sequence 0's context
    expected = paged_attention_varlen(*batch.args())
    assert torch.equal(paged_attention_varlen(*_with(batch, block_tables=tables)), expected)


# --- GPU: the same results on CUDA, on the fast kernels ------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", list(TOLERANCES), ids=str)
@pytest.mark.parametrize("head_dim", [64, 80, 128, 256])
def test_cuda_matches_reference_on_mixed_batch(dtype, head_dim):
    """Prefill, prefill after a cached prefix, decode and an empty sequence in one call, GQA 8:2."""
    batch = make_batch(head_dim=head_dim, dtype=dtype, seed=head_dim).to("cuda")
    pool_before = batch.pool.clone()
    out = paged_attention_varlen(*batch.args())
    assert out.is_cuda and torch.equal(batch.pool, pool_before)
    assert_close_to_reference(out, batch)


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [1, 5, 32])
@pytest.mark.parametrize("num_heads,num_kv_heads", GROUPINGS)
def test_cuda_matches_reference_for_any_block_size_and_grouping(block_size, num_heads, num_kv_heads):
    batch = make_batch((9, 23, 70, 70), (3, 2, 1, 70), num_heads=num_heads, num_kv_heads=num_kv_heads,
                       head_dim=64, block_size=block_size, dtype=torch.bfloat16, seed=block_size).to("cuda")
    assert_close_to_reference(paged_attention_varlen(*batch.args()), batch)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16), ids=str)
def test_cuda_matches_reference_at_llama3_8b_size(dtype):
    """Real sizes, Llama-3-8B's attention (32 heads / 8 KV heads of 128, block 16): four decodes at
    4,096 keys and a 512-token prefill after a 3,584-token cached prefix, in one call."""
    batch = make_batch((4096,) * 5, (1, 1, 1, 1, 512), num_heads=32, num_kv_heads=8, head_dim=128,
                       dtype=dtype, seed=11).to("cuda")
    assert_close_to_reference(paged_attention_varlen(*batch.args()), batch)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["whole prefills", "suffixes", "decodes, unequal", "decodes, equal"])
def test_cuda_bf16_runs_on_flash_and_memory_efficient_kernels_only(case):
    """With SDPA's math fallback switched off, every group kind still runs (no silent slow path)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    context_lens, num_queries = {"whole prefills": ((300, 300), (300, 300)),
                                 "suffixes": ((300, 420), (64, 64)),
                                 "decodes, unequal": ((300, 4000, 17), (1, 1, 1)),
                                 "decodes, equal": ((1000,) * 4, (1,) * 4)}[case]
    batch = make_batch(context_lens, num_queries, num_heads=32, num_kv_heads=8, head_dim=128,
                       dtype=torch.bfloat16, seed=12).to("cuda")
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
        out = paged_attention_varlen(*batch.args(), triton_decode=False)  # decodes through SDPA too
    assert_close_to_reference(out, batch)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16), ids=str)
def test_cuda_decodes_read_blocks_in_place_with_the_triton_kernel(dtype, sdpa_calls):
    """Six decodes of 1 to 4,097 keys (splits, empty splits, a context ending mid-block) at
    Llama-3-8B's attention: no SDPA call, the reference's result, and the SDPA path's."""
    context_lens = (1, 17, 300, 1025, 4097, 2049)
    batch = make_batch(context_lens, (1,) * 6, num_heads=32, num_kv_heads=8, head_dim=128, dtype=dtype,
                       seed=14).to("cuda")
    assert uses_triton_decode(batch.query, batch.key_cache, batch.value_cache)
    out = paged_attention_varlen(*batch.args())
    assert not sdpa_calls
    assert_close_to_reference(out, batch)
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(out, paged_attention_varlen(*batch.args(), triton_decode=False), atol=atol, rtol=rtol)


@pytest.mark.gpu
def test_cuda_mixed_batch_takes_sdpa_for_prefills_and_the_kernel_for_decodes(sdpa_calls):
    """A whole prefill and a suffix (two SDPA calls) beside decodes (the kernel), in one call."""
    batch = make_batch((200, 300, 50, 90, 1), (200, 40, 1, 1, 1), dtype=torch.bfloat16, seed=15).to("cuda")
    out = paged_attention_varlen(*batch.args())
    assert len(sdpa_calls) == 2
    assert_close_to_reference(out, batch)


@pytest.mark.gpu
def test_cuda_metadata_lives_on_the_device_and_the_layer_reads_nothing_back():
    """Built once from host lists; a layer's attention then issues no device-to-host copy."""
    batch = make_batch(dtype=torch.bfloat16, seed=13)
    metadata = PagedAttentionMetadata.build(batch.block_tables.tolist(), batch.context_lens.tolist(),
                                            batch.query_start_loc.tolist(), 16, "cuda")
    assert all(group.block_ids.is_cuda for group in metadata.groups)
    on_cuda = batch.to("cuda")
    paged_attention(on_cuda.query, on_cuda.key_cache, on_cuda.value_cache, metadata, batch.scale)  # compiles
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # a synchronizing call (a .item(), a .tolist()) raises
    try:
        out = paged_attention(on_cuda.query, on_cuda.key_cache, on_cuda.value_cache, metadata, batch.scale)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert_close_to_reference(out, batch)


def test_layer_of_the_pool_is_the_one_read():
    """A guard on the factories: the caches are layer LAYER's views, other layers hold other values."""
    batch = make_batch()
    assert batch.key_cache.data_ptr() == batch.pool[:, LAYER, 0].data_ptr()
    assert not torch.equal(batch.pool[:, 0, 0], batch.key_cache)
