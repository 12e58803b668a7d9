"""The helpers of prefix matching and commit: the hash check and the per-block token split."""

from __future__ import annotations

import pytest

from kvtierd.block_hash import pack_token_ids
from kvtierd.errors import InvalidArgument
from kvtierd.index.prefix_match import check_hashes, split_blocks

HASH_SIZE = 32
GOOD_HASH = bytes(range(HASH_SIZE))


def test_split_blocks_cuts_one_bytes_object_per_block_and_keeps_zero_bytes():
    """Each block gets exactly its 4 * block_size bytes, trailing zero bytes included (small token ids)."""
    token_bytes = pack_token_ids([1, 0, 7, 0, 0, 0, 2**32 - 1, 5])
    blocks = split_blocks(token_bytes, block_size=2)
    assert blocks == (token_bytes[0:8], token_bytes[8:16], token_bytes[16:24], token_bytes[24:32])
    assert blocks[1] == b"\x07\x00\x00\x00" + b"\x00" * 4
    assert all(type(block) is bytes for block in blocks)


def test_split_blocks_of_no_tokens_is_empty():
    assert split_blocks(b"", block_size=16) == ()


def test_check_hashes_accepts_bytes_of_the_hash_size():
    check_hashes([GOOD_HASH, GOOD_HASH[::-1]], HASH_SIZE)
    check_hashes([], HASH_SIZE)


@pytest.mark.parametrize("bad", [GOOD_HASH[:-1], GOOD_HASH + b"\x00", bytearray(GOOD_HASH), memoryview(GOOD_HASH),
                                 GOOD_HASH.hex()[:HASH_SIZE], None])
def test_check_hashes_rejects_a_single_bad_hash_among_good_ones(bad):
    """One hash of the wrong type or length anywhere in the chain is an InvalidArgument."""
    with pytest.raises(InvalidArgument):
        check_hashes([GOOD_HASH, bad, GOOD_HASH], HASH_SIZE)
