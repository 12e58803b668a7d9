"""Prefix matching: the longest verified run of cached blocks at the start of a hash chain.

A hash found in the prefix table is a hit only if the block's stored parent is the chain's
previous hash (the root for block 0, when the index knows it) and, when the caller sent the
prompt's tokens, the block's stored tokens equal them: a hash collision is a miss, never
another request's KV (design §4). The first miss ends the match: a prefix breaks once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvtierd.block_hash import BlockHash, pack_token_ids
from kvtierd.errors import InvalidArgument
from kvtierd.kv_block import KVBlock


def check_hashes(block_hashes: Sequence[bytes], hash_size: int) -> None:
    """InvalidArgument unless every hash is bytes of `hash_size` (checked at C speed)."""
    if set(map(type, block_hashes)) - {bytes} or set(map(len, block_hashes)) - {hash_size}:
        raise InvalidArgument(f"a block hash is {hash_size} bytes")


def pack_prompt_tokens(token_ids: Sequence[int] | bytes | None, num_blocks: int, block_size: int) -> bytes | None:
    """The prompt's tokens, packed, when given; InvalidArgument if they do not cover the blocks."""
    if token_ids is None:
        return None
    token_bytes = pack_token_ids(token_ids)
    if len(token_bytes) < 4 * block_size * num_blocks:
        raise InvalidArgument(f"{num_blocks} hashes need {block_size * num_blocks} tokens, got {len(token_bytes) // 4}")
    return token_bytes


def match_prefix(hash_to_block: Mapping[BlockHash, KVBlock], block_hashes: Sequence[bytes],
                 token_bytes: bytes | None, root: bytes | None, block_size: int) -> list[KVBlock]:
    """The cached blocks of the chain's longest verified prefix. Changes nothing."""
    hits: list[KVBlock] = []
    get = hash_to_block.get
    parent = root
    stride = 4 * block_size
    for i, block_hash in enumerate(block_hashes):
        block = get(block_hash)
        if block is None:
            break
        if parent is not None and block.parent_hash != parent:
            break
        if token_bytes is not None and block.token_ids != token_bytes[i * stride:(i + 1) * stride]:
            break
        hits.append(block)
        parent = block_hash
    return hits
