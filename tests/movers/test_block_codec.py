"""Block codecs: raw copies are bit exact in runs and out of order; fp8 halves the bytes."""

from __future__ import annotations

import pytest
import torch

from kvtierd.errors import InvalidArgument
from kvtierd.movers.block_codec import make_codec
from tests.factories import small_layout

LAYOUT = small_layout()


def random_pool(num_blocks: int) -> torch.Tensor:
    return torch.randn((num_blocks, *LAYOUT.block_shape)).to(LAYOUT.torch_dtype)


@pytest.mark.parametrize("block_ids, slot_ids", [
    ([0, 1, 2, 3], [0, 1, 2, 3]),  # one run
    ([5, 6, 2, 3], [1, 2, 7, 8]),  # two runs
    ([3, 1, 4, 0], [6, 2, 0, 5]),  # no runs
])
def test_raw_round_trip_is_bit_exact(block_ids, slot_ids):
    codec = make_codec("raw", LAYOUT)
    pool, back = random_pool(8), torch.zeros((8, *LAYOUT.block_shape), dtype=LAYOUT.torch_dtype)
    slots = torch.zeros((10, codec.slot_nbytes), dtype=torch.uint8)
    codec.encode(pool, block_ids, slots, slot_ids)
    untouched = [s for s in range(10) if s not in slot_ids]
    assert not slots[untouched].any()
    codec.decode(slots, slot_ids, back, block_ids)
    assert torch.equal(back[block_ids].view(torch.uint8), pool[block_ids].view(torch.uint8))
    assert not back[[b for b in range(8) if b not in block_ids]].any()


def test_raw_codec_on_strided_slot_rows():
    codec = make_codec("raw", LAYOUT)
    pool = random_pool(4)
    slab = torch.zeros((4, codec.slot_nbytes + 4096), dtype=torch.uint8)
    slots = slab[:, :codec.slot_nbytes]  # rows a page apart, as in the host slab
    codec.encode(pool, [0, 1, 2], slots, [0, 1, 2])
    assert not slab[:, codec.slot_nbytes:].any()
    back = torch.zeros_like(pool)
    codec.decode(slots, [0, 1, 2], back, [0, 1, 2])
    assert torch.equal(back[:3], pool[:3])


def test_fp8_codec_stores_half_the_bytes_and_refuses_an_fp8_pool():
    assert make_codec("fp8", LAYOUT).slot_nbytes <= LAYOUT.bytes_per_block // 2 + 64
    with pytest.raises(InvalidArgument):
        make_codec("fp8", small_layout(dtype="float8_e4m3fn"))
    with pytest.raises(InvalidArgument):
        make_codec("zstd", LAYOUT)
    with pytest.raises(InvalidArgument, match="opaque"):
        make_codec("fp8", small_layout(dtype="uint8"))  # pages that are not K and V values
