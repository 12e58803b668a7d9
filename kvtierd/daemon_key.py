"""The daemon's key of a block: the owning tenant's tag, then the client's block hash.

A client hashes its blocks without knowing its tenant (kvtierd.block_hash, tenant ""); the
daemon prefixes every hash it is given with the caller's `TenantTag` (node/tenants.py: a fixed
16-byte digest of the tenant's name), so two tenants' copies of one prefix have different keys
and another tenant's prefix is a plain miss. Every tier, index, quota and event keys blocks by
`DaemonKey`; this module is the one place that knows its layout:

    DaemonKey = tag (TAG_BYTES) + client hash (the pool's digest size: 32 for sha256, 16 for xxh3_128)

The client hash of a block's parent gets the same tag: a chain never crosses tenants.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NewType, cast

TAG_BYTES = 16

TenantTag = NewType("TenantTag", bytes)  # TAG_BYTES bytes, node/tenants.py's digest of a tenant name
DaemonKey = NewType("DaemonKey", bytes)  # TenantTag + client hash


def make_daemon_key(tag: TenantTag, client_hash: bytes) -> DaemonKey:
    assert len(tag) == TAG_BYTES, tag
    return DaemonKey(tag + client_hash)


def make_daemon_keys(tag: TenantTag, client_hashes: Iterable[bytes]) -> list[DaemonKey]:
    """The keys of many client hashes of one tenant (the hot path of Lookup and Acquire): each a
    DaemonKey, made without a wrapper call per key, in a list the core takes as its block keys."""
    assert len(tag) == TAG_BYTES, tag
    return cast("list[DaemonKey]", list(map(tag.__add__, client_hashes)))


def tenant_tag_of(key: DaemonKey) -> TenantTag:
    """The tag of the tenant that owns the block `key` names."""
    return TenantTag(key[:TAG_BYTES])


def client_hash_of(key: DaemonKey) -> bytes:
    """The block hash as the client computed it (what the Events stream and Get answer with)."""
    return key[TAG_BYTES:]


def daemon_key_size(client_hash_size: int) -> int:
    """Bytes of a daemon key over client hashes of `client_hash_size` bytes."""
    return TAG_BYTES + client_hash_size
