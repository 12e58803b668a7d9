"""The entries of a lower tier's slot index: what a tier keeps beside a block's bytes (BlockMeta),
one block in one slot (SlotEntry), and the slots a store was given (StorePlan).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from kvtierd.daemon_key import DaemonKey
from kvtierd.token_bytes import NO_TOKENS, TokenBytes, block_tokens, matching_blocks


@dataclasses.dataclass(frozen=True, slots=True)
class BlockMeta:
    """What a tier keeps beside a block's bytes: its key (the daemon's, daemon_key.py), and what
    verifies it."""

    block_hash: DaemonKey
    parent_hash: DaemonKey
    token_ids: TokenBytes  # the block's tokens (b"" where the caller sent none)


def chain_metas(keys: Sequence[DaemonKey], token_bytes: TokenBytes | None, start: int, stop: int,
                parent: DaemonKey | None, block_size: int) -> list[BlockMeta]:
    """BlockMetas of `keys[start:stop]`, each chained to the key before it (`parent` before the
    first key); token ids b"" where the caller sent none."""
    parents = [keys[start - 1] if start else parent, *keys[start:stop - 1]]
    return [BlockMeta(keys[i], p, block_tokens(token_bytes, i, block_size) if token_bytes is not None else NO_TOKENS)
            for i, p in zip(range(start, stop), parents)]


@dataclasses.dataclass(slots=True, eq=False)
class SlotEntry:
    """One block in one slot. Mutated only by SlotIndex under its lock."""

    meta: BlockMeta
    slot: int
    storing: bool = True  # reserved, bytes being written: invisible and not evictable
    num_loads: int = 0  # pins by loads in flight: not evictable while > 0
    last_use_s: float = 0.0
    entered_at_s: float = 0.0  # when its slot was reserved (restored: when recovered), on the index's clock
    stored_s: float = 0.0  # when it was stored into this tier, on the index's clock (T2 keeps it across restarts)

    @property
    def block_hash(self) -> DaemonKey:
        return self.meta.block_hash


def tail_first(entries: Sequence[SlotEntry]) -> list[SlotEntry]:
    """`entries` with each run given head first (every entry's parent just before it) reversed, the
    rest in order: a batch of a chain's blocks then enters an eviction order tail first whichever
    way it came (a Put, a promotion, a load: head first; a tier's victims: tail first already)."""
    ordered: list[SlotEntry] = []
    start = 0
    for end in range(1, len(entries) + 1):
        if end == len(entries) or entries[end].meta.parent_hash != entries[end - 1].block_hash:
            ordered.extend(reversed(entries[start:end]))
            start = end
    return ordered


@dataclasses.dataclass(slots=True)
class StorePlan:
    """Slots for the blocks that fit, in order; entries evicted to make room (bytes intact); the
    blocks that did not fit, which a caller may store once the index changed (SlotIndex.wait_for_room)."""

    stores: list[SlotEntry]
    evicted: list[SlotEntry]
    num_skipped: int  # blocks already present (stored or being stored) or that did not fit
    unplaced: list[BlockMeta] = dataclasses.field(default_factory=list)  # no slot: every one (or the owner's) in flight
    num_room_changes: int = 0  # the index's count of room changes when planned (SlotIndex.wait_for_room)


def ready_prefix(entries: Mapping[DaemonKey, SlotEntry], block_hashes: Sequence[DaemonKey], parent: DaemonKey | None,
                 token_bytes: TokenBytes | None, block_size: int) -> list[SlotEntry]:
    """The chain's leading READY entries of `entries`, each the child of the one before (of `parent`
    first, where given), and with `token_bytes` those whose tokens match: the first mismatch ends it."""
    hits: list[SlotEntry] = []
    for block_hash in block_hashes:
        entry = entries.get(block_hash)
        if entry is None or entry.storing:
            break
        if parent is not None and entry.meta.parent_hash != parent:
            break
        hits.append(entry)
        parent = block_hash
    if token_bytes is not None and hits:  # verified together, the first mismatch ends the prefix
        hits = hits[:matching_blocks([entry.meta.token_ids for entry in hits], token_bytes, block_size)]
    return hits
