"""Prefix matching: the longest verified run of cached blocks at the start of a hash chain.

A hash found in the prefix table is a hit only if the block's stored parent is the chain's
previous hash (the root for block 0, when the index knows it) and, when the caller sent the
prompt's tokens, the block's stored tokens equal them: a hash collision is a miss, never
another request's KV (design §4). The first miss ends the match: a prefix breaks once.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from typing import cast

from kvtierd.daemon_key import DaemonKey
from kvtierd.errors import InvalidArgument
from kvtierd.index.kv_block import KVBlock
from kvtierd.token_bytes import PackableTokenIds, TokenBytes, check_covers, matching_blocks, pack_optional


def check_hashes(block_hashes: Sequence[bytes], hash_size: int) -> None:
    """InvalidArgument unless every hash is bytes of `hash_size` (checked at C speed: counting in
    a list of types or lengths is cheaper than building a set of them)."""
    num_hashes = len(block_hashes)
    if (list(map(type, block_hashes)).count(bytes) != num_hashes
            or list(map(len, block_hashes)).count(hash_size) != num_hashes):
        raise InvalidArgument(f"a block hash is {hash_size} bytes")


def pack_prompt_tokens(token_ids: PackableTokenIds | None, num_blocks: int, block_size: int) -> TokenBytes | None:
    """The prompt's tokens, packed, when given; InvalidArgument if they do not cover the blocks."""
    token_bytes = pack_optional(token_ids)
    check_covers(token_bytes, num_blocks, block_size)
    return token_bytes


def match_prefix(hash_to_block: Mapping[DaemonKey, KVBlock], block_hashes: Sequence[DaemonKey],
                 token_bytes: TokenBytes | None, root: DaemonKey | None, block_size: int) -> list[KVBlock]:
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
    if token_bytes is not None and hits:
        hits = hits[:matching_blocks(list(map(_TOKENS, hits)), token_bytes, block_size)]
    return hits


_PARENT = operator.attrgetter("parent_hash")
_TOKENS = operator.attrgetter("token_ids")
