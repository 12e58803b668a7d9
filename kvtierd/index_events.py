"""Events of the block index, for prefix-aware routers: what became cached and what left."""

from __future__ import annotations

import dataclasses

from kvtierd.block_hash import BlockHash


@dataclasses.dataclass(frozen=True, slots=True)
class BlockStored:
    """A block became shareable under `block_hash`."""

    block_hash: BlockHash
    parent_hash: BlockHash | None
    block_id: int


@dataclasses.dataclass(frozen=True, slots=True)
class BlockRemoved:
    """The device tier no longer holds `block_hash` (evicted or explicitly dropped)."""

    block_hash: BlockHash


@dataclasses.dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The whole device tier was reset."""


IndexEvent = BlockStored | BlockRemoved | AllBlocksCleared
