"""Prefix matching: the longest verified run of cached blocks at the start of a hash chain.

A hash found in the prefix table is a hit only if the block's stored parent is the chain's
previous hash (the root for block 0, when the index knows it) and, when the caller sent the
prompt's tokens, the block's stored tokens equal them: a hash collision is a miss, never
another request's KV (design §4). The first miss ends the match: a prefix breaks once.
"""

from __future__ import annotations

import functools
import operator
import struct
from collections.abc import Mapping, Sequence
from typing import cast

from kvtierd.block_hash import pack_token_ids
from kvtierd.errors import InvalidArgument
from kvtierd.index.kv_block import KVBlock


def check_hashes(block_hashes: Sequence[bytes], hash_size: int) -> None:
    """InvalidArgument unless every hash is bytes of `hash_size` (checked at C speed: counting in
    a list of types or lengths is cheaper than building a set of them)."""
    num_hashes = len(block_hashes)
    if (list(map(type, block_hashes)).count(bytes) != num_hashes
            or list(map(len, block_hashes)).count(hash_size) != num_hashes):
        raise InvalidArgument(f"a block hash is {hash_size} bytes")


def split_blocks(token_bytes: bytes, block_size: int) -> tuple[bytes, ...]:
    """Packed tokens cut into one bytes object per block of `block_size` tokens (the length is a
    whole number of blocks, checked by the caller). One C-level unpack: slicing block by block in
    Python cost ~85 ns a block, the unpack ~15."""
    return _block_struct(len(token_bytes) // (4 * block_size), block_size).unpack(token_bytes)


@functools.lru_cache(maxsize=64)
def _block_struct(num_blocks: int, block_size: int) -> struct.Struct:
    """A struct of `num_blocks` fixed-size byte fields of `block_size` u32 tokens each."""
    return struct.Struct(f"{4 * block_size}s" * num_blocks)


def pack_prompt_tokens(token_ids: Sequence[int] | bytes | None, num_blocks: int, block_size: int) -> bytes | None:
    """The prompt's tokens, packed, when given; InvalidArgument if they do not cover the blocks."""
    if token_ids is None:
        return None
    token_bytes = pack_token_ids(token_ids)
    if len(token_bytes) < 4 * block_size * num_blocks:
        raise InvalidArgument(f"{num_blocks} hashes need {block_size * num_blocks} tokens, got {len(token_bytes) // 4}")
    return token_bytes


def match_prefix(hash_to_block: Mapping[bytes, KVBlock], block_hashes: Sequence[bytes],
                 token_bytes: bytes | None, root: bytes | None, block_size: int) -> list[KVBlock]:
    """The cached blocks of the chain's longest verified prefix. Changes nothing.

    Found blocks are verified in bulk (list and bytes comparisons run at C speed); only when a
    comparison fails is the first failing block looked for, one by one.
    """
    found = list(map(hash_to_block.get, block_hashes))
    num_hits = found.index(None) if None in found else len(found)
    if num_hits == 0:
        return []
    hits = cast("list[KVBlock]", found[:num_hits])  # the blocks before the first miss: none is None
    parents = list(map(_PARENT, hits))
    expected = [root, *block_hashes[:num_hits - 1]]
    if root is None:  # no fixed root: block 0's parent is not checked
        parents[0] = None
    if parents != expected:
        num_hits = next(i for i, (got, want) in enumerate(zip(parents, expected)) if got != want)
        hits = hits[:num_hits]
    stride = 4 * block_size
    if token_bytes is not None and hits and b"".join(map(_TOKENS, hits)) != token_bytes[:len(hits) * stride]:
        num_hits = next(i for i, block in enumerate(hits)
                        if block.token_ids != token_bytes[i * stride:(i + 1) * stride])
        hits = hits[:num_hits]
    return hits


_PARENT = operator.attrgetter("parent_hash")
_TOKENS = operator.attrgetter("token_ids")
