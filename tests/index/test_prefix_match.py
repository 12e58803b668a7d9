"""The helpers of prefix matching and commit: the hash check (the per-block token split: tests/test_token_bytes.py)."""

from __future__ import annotations

import pytest

from kvtierd.errors import InvalidArgument
from kvtierd.index.prefix_match import check_hashes

HASH_SIZE = 32
GOOD_HASH = bytes(range(HASH_SIZE))


def test_check_hashes_accepts_bytes_of_the_hash_size():
    check_hashes([GOOD_HASH, GOOD_HASH[::-1]], HASH_SIZE)
    check_hashes([], HASH_SIZE)


@pytest.mark.parametrize("bad", [GOOD_HASH[:-1], GOOD_HASH + b"\x00", bytearray(GOOD_HASH), memoryview(GOOD_HASH),
                                 GOOD_HASH.hex()[:HASH_SIZE], None])
def test_check_hashes_rejects_a_single_bad_hash_among_good_ones(bad):
    """One hash of the wrong type or length anywhere in the chain is an InvalidArgument."""
    with pytest.raises(InvalidArgument):
        check_hashes([GOOD_HASH, bad, GOOD_HASH], HASH_SIZE)
