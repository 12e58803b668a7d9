"""Packed token ids and the one way to cut them into blocks: spans, single blocks and the fast
split agree with each other and with the ids they were packed from."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtierd.errors import InvalidArgument
from kvtierd.index.slot_entry import BlockMeta, chain_metas
from kvtierd.token_bytes import (
    NO_TOKENS,
    TOKEN_ID_BYTES,
    block_span,
    block_tokens,
    check_covers,
    matching_blocks,
    pack_optional,
    pack_token_ids,
    packed_size,
    split_blocks,
    token_count,
)

BLOCK_SIZE = 2
TOKENS = [1, 0, 7, 0, 0, 0, 2**32 - 1, 5, 9]  # four full blocks of 2 and a partial fifth
PACKED = pack_token_ids(TOKENS)


def ids(tokens: bytes) -> list[int]:
    return list(struct.unpack(f"<{len(tokens) // 4}I", tokens))


def test_token_ids_pack_as_u32_little_endian_in_every_form():
    assert TOKEN_ID_BYTES == 4
    assert pack_token_ids([1, 2**32 - 1]) == b"\x01\x00\x00\x00\xff\xff\xff\xff"
    assert pack_token_ids(np.array(TOKENS, dtype=np.int64)) == pack_token_ids(tuple(TOKENS)) == PACKED
    assert pack_token_ids(PACKED) == PACKED  # bytes are taken as packed already
    assert pack_token_ids(np.array([], dtype=np.int64)) == b""
    with pytest.raises(InvalidArgument):
        pack_token_ids(PACKED[:-1])  # not a whole number of token ids


def test_pack_optional_passes_none_through():
    assert pack_optional(None) is None
    assert pack_optional(TOKENS) == PACKED


def test_sizes_count_four_bytes_a_token():
    assert packed_size(16) == 64
    assert packed_size(0) == 0
    assert token_count(PACKED) == len(TOKENS)


def test_block_tokens_are_the_ids_of_that_block_only():
    assert ids(block_tokens(PACKED, 0, BLOCK_SIZE)) == [1, 0]
    assert ids(block_tokens(PACKED, 1, BLOCK_SIZE)) == [7, 0]
    assert ids(block_tokens(PACKED, 3, BLOCK_SIZE)) == [2**32 - 1, 5]  # the last full block
    assert ids(block_tokens(PACKED, 4, BLOCK_SIZE)) == [9]  # a partial block: what is there
    assert block_tokens(PACKED, 5, BLOCK_SIZE) == b""  # past the end
    assert ids(block_tokens(PACKED, 1, 3)) == [0, 0, 0]  # the stride follows the block size


def test_block_span_takes_blocks_start_to_stop():
    assert ids(block_span(PACKED, 0, 2, BLOCK_SIZE)) == [1, 0, 7, 0]
    assert ids(block_span(PACKED, 1, 3, BLOCK_SIZE)) == [7, 0, 0, 0]
    assert ids(block_span(PACKED, 3, 4, BLOCK_SIZE)) == [2**32 - 1, 5]
    assert block_span(PACKED, 2, 2, BLOCK_SIZE) == b""
    assert ids(block_span(PACKED, 2, None, BLOCK_SIZE)) == TOKENS[4:]  # no stop: to the end, partial block too
    assert block_span(PACKED, 0, None, BLOCK_SIZE) == PACKED
    assert ids(block_span(PACKED, 3, 10, BLOCK_SIZE)) == TOKENS[6:]  # a stop past the end: what is there


def test_none_tokens_stay_none():
    assert block_span(None, 0, 2, BLOCK_SIZE) is None
    assert block_span(None, 1, None, BLOCK_SIZE) is None
    assert block_tokens(None, 0, BLOCK_SIZE) is None


def test_split_blocks_cuts_one_bytes_object_per_block_and_keeps_zero_bytes():
    """Each block gets exactly its 4 * block_size bytes, trailing zero bytes included (small token ids)."""
    token_bytes = pack_token_ids(TOKENS[:8])
    blocks = split_blocks(token_bytes, block_size=2)
    assert blocks == (token_bytes[0:8], token_bytes[8:16], token_bytes[16:24], token_bytes[24:32])
    assert blocks[1] == b"\x07\x00\x00\x00" + b"\x00" * 4
    assert all(type(block) is bytes for block in blocks)


def test_split_blocks_of_no_tokens_is_empty():
    assert split_blocks(pack_token_ids([]), block_size=16) == ()


@given(tokens=st.lists(st.integers(0, 2**32 - 1), max_size=40), block_size=st.integers(1, 5),
       start=st.integers(0, 10), length=st.integers(0, 10))
def test_every_cut_agrees_with_the_ids(tokens, block_size, start, length):
    packed = pack_token_ids(tokens)
    num_blocks = len(tokens) // block_size
    whole = block_span(packed, 0, num_blocks, block_size)
    assert split_blocks(whole, block_size) == tuple(block_tokens(packed, i, block_size) for i in range(num_blocks))
    span = block_span(packed, start, start + length, block_size)
    assert ids(span) == tokens[start * block_size:(start + length) * block_size]
    assert span == b"".join(block_tokens(packed, i, block_size) for i in range(start, start + length))


def test_check_covers_wants_every_block_full():
    check_covers(PACKED, 4, BLOCK_SIZE)  # 9 tokens cover 4 blocks of 2
    check_covers(None, 100, BLOCK_SIZE)  # no tokens sent: nothing to check
    check_covers(b"", 0, BLOCK_SIZE)
    with pytest.raises(InvalidArgument, match="5 hashes need 10 tokens, got 9"):
        check_covers(PACKED, 5, BLOCK_SIZE)


def test_chain_metas_chain_each_key_to_the_one_before_with_its_block_tokens():
    keys = [b"k0", b"k1", b"k2", b"k3"]
    assert chain_metas(keys, PACKED, 1, 3, b"root", BLOCK_SIZE) == [
        BlockMeta(b"k1", b"k0", block_tokens(PACKED, 1, BLOCK_SIZE)),
        BlockMeta(b"k2", b"k1", block_tokens(PACKED, 2, BLOCK_SIZE))]
    assert chain_metas(keys, None, 0, 2, b"root", BLOCK_SIZE) == [  # no tokens sent: b"" each
        BlockMeta(b"k0", b"root", NO_TOKENS), BlockMeta(b"k1", b"k0", NO_TOKENS)]
    assert chain_metas(keys, PACKED, 2, 2, b"root", BLOCK_SIZE) == []


@given(tokens=st.lists(st.integers(0, 9), min_size=0, max_size=24), block_size=st.integers(1, 4),
       changes=st.lists(st.tuples(st.integers(0, 7), st.sampled_from(["other", "none", "short"])), max_size=3))
def test_matching_blocks_counts_the_leading_equal_blocks(tokens, block_size, changes):
    """Against a block-by-block comparison: stored blocks with another id, none sent (b""), or cut short."""
    packed = pack_token_ids(tokens)
    stored = [block_tokens(packed, i, block_size) for i in range(len(tokens) // block_size)]
    for index, change in changes:
        if index < len(stored):
            block = stored[index]
            stored[index] = {"other": pack_token_ids([10] * block_size), "none": b"",
                             "short": block[:-4]}[change]
    expected = next((i for i, block in enumerate(stored) if block != block_tokens(packed, i, block_size)),
                    len(stored))
    assert matching_blocks(stored, packed, block_size) == expected


def test_matching_blocks_stops_at_the_first_mismatch_even_when_the_join_lines_up():
    """b"" then a block of two blocks' ids would join equal; the count must still be 0."""
    packed = pack_token_ids([1, 2, 3, 4])
    assert matching_blocks([b"", packed], packed, 2) == 0
    assert matching_blocks([block_tokens(packed, 0, 2), block_tokens(packed, 1, 2)], packed, 2) == 2
    assert matching_blocks([block_tokens(packed, 0, 2), pack_token_ids([3, 5])], packed, 2) == 1
