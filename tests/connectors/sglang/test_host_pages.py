"""SGLang's host pools as pages in block order: every host layout, MHA and MLA (no SGLang needed)."""

from __future__ import annotations

import pytest
import torch

from kvtierd.connectors.sglang.host_pages import HostPages, UnsupportedHostPool
from kvtierd.connectors.sglang.page_layout import EngineShard, UnsupportedEngine, page_layout

LAYERS, HEADS, DIM, PAGE, NUM_PAGES = 3, 2, 4, 4, 5
SIZE = PAGE * NUM_PAGES

# The buffer shapes of sglang 0.5.23's init_kv_buffer (pool_host/mha.py, mla.py).
MHA_SHAPES = {
    "layer_first": (2, LAYERS, SIZE, HEADS, DIM),
    "page_first": (2, SIZE, LAYERS, HEADS, DIM),
    "page_first_direct": (2, NUM_PAGES, LAYERS, PAGE, HEADS, DIM),
    "page_head": (2, NUM_PAGES, HEADS, PAGE, LAYERS, DIM),
}
MLA_SHAPES = {
    "layer_first": (LAYERS, SIZE, 1, DIM),
    "page_first": (SIZE, LAYERS, 1, DIM),
    "page_first_direct": (NUM_PAGES, LAYERS, PAGE, 1, DIM),
}


def mha_element(buffer: torch.Tensor, host_layout: str, page: int, layer: int, kv: int, token: int, head: int):
    """The element SGLang's own indexing names, written out per layout (its get_data_page slices)."""
    slot = page * PAGE + token
    return {"layer_first": lambda: buffer[kv, layer, slot, head],
            "page_first": lambda: buffer[kv, slot, layer, head],
            "page_first_direct": lambda: buffer[kv, page, layer, token, head],
            "page_head": lambda: buffer[kv, page, head, token, layer]}[host_layout]()


@pytest.mark.parametrize("host_layout", MHA_SHAPES)
def test_an_mha_page_is_k_and_v_of_every_layer_in_the_daemons_block_order(host_layout):
    buffer = torch.randn(MHA_SHAPES[host_layout])
    pages = HostPages.of_buffer(buffer, "mha", host_layout, PAGE)
    assert pages.num_pages == NUM_PAGES and pages.block_shape == (LAYERS, 2, PAGE, HEADS, DIM)
    for page, layer, kv, token, head in [(0, 0, 0, 0, 0), (3, 2, 1, 3, 1), (4, 1, 0, 2, 1)]:
        assert torch.equal(pages.view[page, layer, kv, token, head],
                           mha_element(buffer, host_layout, page, layer, kv, token, head))


@pytest.mark.parametrize("host_layout", MHA_SHAPES)
def test_pages_written_through_the_view_land_in_the_buffer_and_read_back(host_layout):
    buffer = torch.zeros(MHA_SHAPES[host_layout], dtype=torch.float16)
    pages = HostPages.of_buffer(buffer, "mha", host_layout, PAGE)
    blocks = torch.randn(2, *pages.block_shape).to(torch.float16)
    pages.write([3, 1], blocks.reshape(2, -1).view(torch.uint8))  # as bytes, the way the pool hands them over
    assert torch.equal(pages.read([3, 1]), blocks)
    assert torch.equal(pages.read([0, 2, 4]), torch.zeros(3, *pages.block_shape, dtype=torch.float16))
    assert torch.equal(pages.view[3, 1, 1, 2], mha_element(buffer, host_layout, 3, 1, 1, 2, slice(None)))
    assert buffer.count_nonzero() == blocks.count_nonzero()


@pytest.mark.parametrize("host_layout", MLA_SHAPES)
def test_an_mla_page_is_every_layers_latents_of_its_tokens(host_layout):
    buffer = torch.randn(MLA_SHAPES[host_layout])
    pages = HostPages.of_buffer(buffer, "mla", host_layout, PAGE)
    assert pages.block_shape == (LAYERS, PAGE, 1, DIM)
    slot = 2 * PAGE + 3
    expected = {"layer_first": lambda: buffer[1, slot], "page_first": lambda: buffer[slot, 1],
                "page_first_direct": lambda: buffer[2, 1, 3]}[host_layout]()
    assert torch.equal(pages.view[2, 1, 3], expected)


def test_host_indices_name_whole_pages():
    pages = HostPages.of_buffer(torch.zeros(MHA_SHAPES["layer_first"]), "mha", "layer_first", PAGE)
    assert pages.page_ids(torch.arange(2 * PAGE, 4 * PAGE)) == [2, 3]
    assert pages.page_ids(torch.cat([torch.arange(4 * PAGE, 5 * PAGE), torch.arange(0, PAGE)])) == [4, 0]
    with pytest.raises(ValueError, match="whole pages"):
        pages.page_ids(torch.arange(0, PAGE + 1))
    with pytest.raises(ValueError, match="page boundary"):
        pages.page_ids(torch.arange(1, PAGE + 1))


def test_unknown_host_layouts_and_kinds_are_refused_in_one_line():
    with pytest.raises(UnsupportedHostPool, match="page_unified"):
        HostPages.of_buffer(torch.zeros(4), "mha", "page_unified", PAGE)
    with pytest.raises(UnsupportedHostPool, match="page_head"):
        HostPages.of_buffer(torch.zeros(MHA_SHAPES["page_head"]), "mla", "page_head", PAGE)
    with pytest.raises(UnsupportedHostPool, match="kind"):
        HostPages.of_buffer(torch.zeros(4), "mamba", "layer_first", PAGE)


def test_the_layout_names_the_model_format_and_shard():
    mha = page_layout(EngineShard("m", tp_rank=1, tp_size=2), (LAYERS, 2, PAGE, HEADS, DIM), "bfloat16")
    assert (mha.model_id, mha.num_layers, mha.num_kv_heads, mha.head_dim, mha.block_size) == \
        ("m@sglang-mha", LAYERS, HEADS, DIM, PAGE)
    assert (mha.dtype, mha.tp_rank, mha.tp_size) == ("bfloat16", 1, 2)
    staged = page_layout(EngineShard("m", pp_rank=1, pp_size=2), (LAYERS, 2, PAGE, HEADS, DIM), "float16")
    assert staged.model_id == "m@sglang-mha/pp1of2" and staged != mha
    mla = page_layout(EngineShard("m", is_mla=True), (LAYERS, PAGE, 1, 576), "bfloat16")
    assert (mla.model_id, mla.dtype, mla.tp_size) == ("m@sglang-mla", "uint8", 1)
    assert mla.bytes_per_block == LAYERS * PAGE * 576 * 2
    with pytest.raises(UnsupportedEngine, match="dtype"):
        page_layout(EngineShard("m"), (LAYERS, 2, PAGE, HEADS, DIM), "int8")
    with pytest.raises(UnsupportedEngine, match="model name"):
        page_layout(EngineShard(""), (LAYERS, 2, PAGE, HEADS, DIM), "float16")


@pytest.mark.parametrize("host_layout", MHA_SHAPES)
def test_pages_copy_out_to_block_rows_and_back_in_one_copy_each(host_layout):
    buffer = torch.randn(MHA_SHAPES[host_layout]).half()
    pages = HostPages.of_buffer(buffer, "mha", host_layout, PAGE)
    rows = torch.zeros(2, pages.page_nbytes, dtype=torch.uint8)
    pages.copy_out([4, 1], list(rows))
    assert torch.equal(rows.view(torch.float16).view(2, *pages.block_shape), pages.read([4, 1]))
    pages.copy_in([0, 2], list(rows))
    assert torch.equal(pages.read([0, 2]), pages.read([4, 1]))
