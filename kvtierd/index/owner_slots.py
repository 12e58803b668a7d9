"""Per-owner slot quotas of a slot index (slot_index.py): how many slots each owner (a tenant) holds
and the most it may. An owner at its limit stores a new block in the slot of its own least recently
used entry; with none evictable the block is not stored (counted in `num_skips`).
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable

from kvtierd.daemon_key import DaemonKey
from kvtierd.index.slot_entry import SlotEntry


class OwnerSlots:
    """The slots held by owner, for one slot index, under that index's lock.

    Invariant: once `limit_by` was called, `count(owner)` is the number of the index's entries of
    that owner (STORING ones included): the index calls `added` and `removed` for every entry it
    inserts and deletes. Before, nothing is counted and no owner has a limit."""

    def __init__(self) -> None:
        self.owner_of: Callable[[DaemonKey], bytes] | None = None
        self._max_slots_of: Callable[[bytes], int | None] = lambda owner: None
        self._counts: collections.Counter[bytes] = collections.Counter()
        self.num_skips = 0  # blocks not stored: their owner was at its limit with nothing evictable

    def limit_by(self, owner_of: Callable[[DaemonKey], bytes], max_slots_of: Callable[[bytes], int | None],
                 held: Iterable[DaemonKey]) -> None:
        """Owners by `owner_of(block_hash)`, each limited to `max_slots_of(owner)` slots (None: no
        limit); `held`: the hashes the index holds now (an owner above a lowered limit, or after a
        restore, keeps its count while it recycles its own slots)."""
        self.owner_of = owner_of
        self._max_slots_of = max_slots_of
        self._counts = collections.Counter(map(owner_of, held))

    def full_owner(self, block_hash: DaemonKey) -> bytes | None:
        """The block's owner when that owner holds its limit already (a store of the block must
        recycle one of the owner's own slots); None otherwise."""
        if self.owner_of is None:
            return None
        owner = self.owner_of(block_hash)
        limit = self._max_slots_of(owner)
        return owner if limit is not None and self._counts[owner] >= limit else None

    def oldest_of(self, owner: bytes, evictable: Iterable[SlotEntry]) -> SlotEntry | None:
        """The first of `evictable` (least recently used first) that `owner` holds; None: none is."""
        assert self.owner_of is not None, "no owner has a limit before limit_by"
        owner_of = self.owner_of
        return next((entry for entry in evictable if owner_of(entry.block_hash) == owner), None)

    def added(self, block_hash: DaemonKey) -> None:
        if self.owner_of is not None:
            self._counts[self.owner_of(block_hash)] += 1

    def removed(self, block_hash: DaemonKey) -> None:
        if self.owner_of is not None:
            owner = self.owner_of(block_hash)
            self._counts[owner] -= 1
            assert self._counts[owner] >= 0, "an owner's count went below zero"

    def count(self, owner: bytes) -> int:
        return self._counts[owner]


def slots_within(limit_bytes: int | None, slot_stride_bytes: int) -> int | None:
    """How many slots of `slot_stride_bytes` a byte limit allows (None: no limit)."""
    return None if limit_bytes is None else limit_bytes // slot_stride_bytes
