"""The entries of a lower tier's slot index: what a tier keeps beside a block's bytes (BlockMeta),
one block in one slot (SlotEntry), and the slots a store was given (StorePlan).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, slots=True)
class BlockMeta:
    """What a tier keeps beside a block's bytes: its key, and what verifies it. Keys are a
    namespace's block hashes (block_hash.py), or the daemon's keys (daemon_key.py)."""

    block_hash: bytes
    parent_hash: bytes
    token_ids: bytes  # packed u32


@dataclasses.dataclass(slots=True, eq=False)
class SlotEntry:
    """One block in one slot. Mutated only by SlotIndex under its lock."""

    meta: BlockMeta
    slot: int
    storing: bool = True  # reserved, bytes being written: invisible and not evictable
    num_loads: int = 0  # pins by loads in flight: not evictable while > 0
    last_use_s: float = 0.0

    @property
    def block_hash(self) -> bytes:
        return self.meta.block_hash


@dataclasses.dataclass(slots=True)
class StorePlan:
    """Slots for the blocks that fit, in order; entries evicted to make room (bytes intact)."""

    stores: list[SlotEntry]
    evicted: list[SlotEntry]
    num_skipped: int  # blocks already present (stored or being stored) or that did not fit
