"""Packed token ids: a prompt's tokens as the daemon carries them, and the one way to cut them.

    TokenBytes = token id 0 | token id 1 | ...      each a u32 little-endian (TOKEN_ID_BYTES bytes)

The wire, the block index, every tier's metadata (BlockMeta), T3's frames and the KV events carry
a block's tokens this way; `pack_token_ids` makes them from ids in any form (and only checks the
length of bytes already packed). Block `i` of a prompt of blocks of `block_size` tokens is the
bytes [i * stride, (i + 1) * stride), stride = TOKEN_ID_BYTES * block_size: the functions below
are the only place that computes it.

Cutting past the end gives what is there (a short or empty block), as slicing does: callers that
need whole blocks check first (`check_covers`) or compare, so a short block is a mismatch. A
function here that takes `None` for the tokens (the caller sent none) gives back None.
"""

from __future__ import annotations

import functools
import struct
import sys
from array import array
from collections.abc import Sequence
from typing import NewType, cast, overload

import numpy as np

from kvtierd.errors import InvalidArgument
from kvtierd.hash_chain_native import native_pack_u32

TOKEN_ID_BYTES = 4
MAX_TOKEN_ID = 2**32 - 1

TokenBytes = NewType("TokenBytes", bytes)  # token ids, each a u32 little-endian (TOKEN_ID_BYTES bytes)
NO_TOKENS = TokenBytes(b"")  # a block's tokens where the caller sent none
PackableTokenIds = Sequence[int] | np.ndarray | bytes  # what pack_token_ids takes

_U32_CODE = next(code for code in "IL" if array(code).itemsize == TOKEN_ID_BYTES)
_pack_u32 = native_pack_u32()  # None where the C loop was not built


def pack_token_ids(token_ids: PackableTokenIds) -> TokenBytes:
    """Token ids as u32 little-endian bytes; raises InvalidArgument outside [0, 2**32).

    Bytes are taken as already packed (the wire format): no conversion, only a length check.
    """
    if isinstance(token_ids, (bytes, bytearray, memoryview)):
        if len(token_ids) % TOKEN_ID_BYTES:
            raise InvalidArgument(f"packed token ids are 4 bytes each, got {len(token_ids)} bytes")
        return TokenBytes(bytes(token_ids))
    if isinstance(token_ids, (list, tuple, range)):
        try:
            if _pack_u32 is not None and not isinstance(token_ids, range):
                return TokenBytes(_pack_u32(token_ids))  # the C loop: ~1.6 ns a token, array's ~6
            packed = array(_U32_CODE, token_ids)  # C-speed for Python ints; rejects floats
        except (OverflowError, TypeError):
            raise InvalidArgument(f"token ids must be integers in [0, {MAX_TOKEN_ID}]") from None
        if sys.byteorder == "big":
            packed.byteswap()
        return TokenBytes(packed.tobytes())
    array_ = np.asarray(token_ids)
    if array_.ndim != 1:
        raise InvalidArgument(f"token ids must be one-dimensional, got shape {array_.shape}")
    if array_.size == 0:
        return TokenBytes(b"")
    if array_.dtype.kind not in "iu":
        raise InvalidArgument(f"token ids must be integers, got dtype {array_.dtype}")
    if array_.dtype != np.uint32:
        if int(array_.min()) < 0 or int(array_.max()) > MAX_TOKEN_ID:
            raise InvalidArgument(f"token ids must lie in [0, {MAX_TOKEN_ID}]")
    return TokenBytes(array_.astype("<u4", copy=False).tobytes())


def pack_optional(token_ids: PackableTokenIds | None) -> TokenBytes | None:
    """`pack_token_ids`, or None when there are none (the caller sent no tokens)."""
    return pack_token_ids(token_ids) if token_ids is not None else None


def packed_size(num_tokens: int) -> int:
    """Bytes of `num_tokens` packed token ids (of a block: `packed_size(block_size)`)."""
    return TOKEN_ID_BYTES * num_tokens


def token_count(tokens: bytes) -> int:
    """How many token ids `tokens` holds."""
    return len(tokens) // TOKEN_ID_BYTES


def check_covers(tokens: bytes | None, num_blocks: int, block_size: int) -> None:
    """InvalidArgument unless `tokens` (when given) hold at least `num_blocks` full blocks."""
    if tokens is not None and len(tokens) < packed_size(block_size * num_blocks):
        raise InvalidArgument(f"{num_blocks} hashes need {block_size * num_blocks} tokens, got {token_count(tokens)}")


@overload
def block_span(tokens: TokenBytes, start_block: int, stop_block: int | None, block_size: int) -> TokenBytes: ...


@overload
def block_span(tokens: None, start_block: int, stop_block: int | None, block_size: int) -> None: ...


def block_span(tokens: TokenBytes | None, start_block: int, stop_block: int | None,
               block_size: int) -> TokenBytes | None:
    """The tokens of blocks [start_block, stop_block) (to the end when `stop_block` is None),
    one slice; None when `tokens` is None."""
    if tokens is None:
        return None
    stride = TOKEN_ID_BYTES * block_size
    return TokenBytes(tokens[start_block * stride:None if stop_block is None else stop_block * stride])


@overload
def block_tokens(tokens: TokenBytes, index: int, block_size: int) -> TokenBytes: ...


@overload
def block_tokens(tokens: None, index: int, block_size: int) -> None: ...


def block_tokens(tokens: TokenBytes | None, index: int, block_size: int) -> TokenBytes | None:
    """The tokens of block `index` (b"" past the end); None when `tokens` is None."""
    if tokens is None:
        return None
    stride = TOKEN_ID_BYTES * block_size
    return TokenBytes(tokens[index * stride:(index + 1) * stride])


def matching_blocks(stored: Sequence[bytes], tokens: TokenBytes, block_size: int) -> int:
    """How many leading blocks of `stored` (each one block's packed tokens, or b"" where none were
    sent) equal the blocks of `tokens`. Compared at C speed, all at once (the lengths counted, one
    join, one bytes comparison); block by block only when that fails, to find the first mismatch."""
    num_blocks, stride = len(stored), packed_size(block_size)
    if (list(map(len, stored)).count(stride) == num_blocks  # every entry a whole block, so the join lines up
            and b"".join(stored) == block_span(tokens, 0, num_blocks, block_size)):
        return num_blocks
    return next((i for i, block in enumerate(stored) if block != block_tokens(tokens, i, block_size)), num_blocks)


def tokens_of_blocks(tokens: TokenBytes, num_blocks: int, block_size: int) -> tuple[TokenBytes, ...]:
    """Each of `num_blocks` blocks' packed tokens: cut from `tokens` (a whole number of blocks,
    checked by the caller), or NO_TOKENS for every block where `tokens` is empty (an engine that
    keys its blocks by its own content hash and never tells the tokens: SGLang's storage API)."""
    return split_blocks(tokens, block_size) if tokens else (NO_TOKENS,) * num_blocks


def split_blocks(tokens: TokenBytes, block_size: int) -> tuple[TokenBytes, ...]:
    """Packed tokens cut into one bytes object per block of `block_size` tokens (the length is a
    whole number of blocks, checked by the caller). One C-level unpack: slicing block by block in
    Python cost ~85 ns a block, the unpack ~15."""
    blocks = _block_struct(len(tokens) // (TOKEN_ID_BYTES * block_size), block_size).unpack(tokens)
    return cast("tuple[TokenBytes, ...]", blocks)


@functools.lru_cache(maxsize=64)
def _block_struct(num_blocks: int, block_size: int) -> struct.Struct:
    """A struct of `num_blocks` fixed-size byte fields of `block_size` u32 tokens each."""
    return struct.Struct(f"{TOKEN_ID_BYTES * block_size}s" * num_blocks)
