"""What a KvTier request names, validated and turned into the core's terms: client hashes into
the daemon's keys by the tenant's prefix (here, and only here: `client_keys`), token ids, a
Lookup's chains, a block's parent, where blocks sit in a request's table. Each raises
InvalidArgument or FailedPrecondition before anything is changed."""

from __future__ import annotations

from collections.abc import Iterable

from kvtierd.daemon_key import DaemonKey
from kvtierd.errors import FailedPrecondition, InvalidArgument
from kvtierd.index.prefix_match import check_hashes
from kvtierd.node.pools import LayoutPool
from kvtierd.node.tenants import Tenant
from kvtierd.token_bytes import TokenBytes, block_span, check_covers, pack_token_ids


def client_keys(tenant: Tenant, pool: LayoutPool, client_hashes: Iterable[bytes]) -> list[DaemonKey]:
    client_hashes = list(client_hashes)  # a protobuf repeated field makes new bytes on every read: read once
    check_hashes(client_hashes, pool.digest_size)
    return tenant.keys(client_hashes)


MAX_HOLD_ID_CHARS = 256


def check_hold_id(hold_id: str) -> None:
    """A Lookup's or Acquire's hold_id (lookup_holds.py): an engine's request id, not a payload."""
    if len(hold_id) > MAX_HOLD_ID_CHARS:
        raise InvalidArgument(f"hold_id must be at most {MAX_HOLD_ID_CHARS} characters, got {len(hold_id)}")


def packed_tokens(token_ids: bytes) -> TokenBytes | None:
    return pack_token_ids(token_ids) if token_ids else None


def chains_of(keys: list[DaemonKey], token_bytes: TokenBytes | None, chain_lengths: list[int],
              block_size: int) -> list[tuple[list[DaemonKey], TokenBytes | None]]:
    """(keys, token bytes) of each chain a Lookup names (all the keys: one chain, without lengths)."""
    if not chain_lengths:
        return [(keys, token_bytes)]
    if min(chain_lengths) < 1 or sum(chain_lengths) != len(keys):
        raise InvalidArgument(f"chain_lengths must be >= 1 each and sum to the {len(keys)} hashes, "
                              f"got {len(chain_lengths)} lengths summing to {sum(chain_lengths)}")
    check_covers(token_bytes, len(keys), block_size)
    chains, start = [], 0
    for length in chain_lengths:
        end = start + length
        chains.append((keys[start:end], block_span(token_bytes, start, end, block_size)))
        start = end
    return chains


def parent_key(tenant: Tenant, pool: LayoutPool, position: int, parent_hash: bytes,
               first_parent: bytes | None = None) -> DaemonKey:
    """The daemon's key of the parent of the block at `position`; block 0's must be
    `first_parent` (the hash the request's Acquire continued) or, without one, the root."""
    check_hashes([parent_hash], pool.digest_size)
    if position == 0 and parent_hash != (first_parent or pool.client_root):
        if first_parent is not None:
            raise InvalidArgument("the parent of a request's first block must be the parent_hash its Acquire named")
        raise InvalidArgument("the parent of a request's first block must be the root hash from Attach")
    return tenant.key(parent_hash)


def acquire_parent(pool: LayoutPool, parent_hash: bytes) -> bytes | None:
    """An Acquire's parent_hash, checked (None when it names none: the chain starts at the root)."""
    if not parent_hash:
        return None
    check_hashes([parent_hash], pool.digest_size)
    return parent_hash


def position_of(pool: LayoutPool, table: list[int], block_ids: list[int], request_id: str) -> int:
    """Where consecutive `block_ids` start in the request's table."""
    if any(b >= pool.num_blocks for b in block_ids):
        raise InvalidArgument(f"block ids must be in [0, {pool.num_blocks})")
    try:
        position = table.index(block_ids[0])
    except ValueError:
        raise FailedPrecondition(f"block {block_ids[0]} is not held by request {request_id!r}") from None
    if table[position:position + len(block_ids)] != block_ids:
        raise FailedPrecondition(f"blocks {block_ids} are not consecutive blocks of request {request_id!r}")
    return position
