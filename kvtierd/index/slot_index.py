"""The slot index of a lower tier (host DRAM, SSD): which fixed-size slot holds which block.

Each slot holds one block. Entries are found by block hash and evicted least recently used
first (or in the order `set_eviction` names). Operations that move bytes are two-phase, so a slot
in flight is never evicted or reused:

- `prepare_store(blocks)` reserves one slot per new block: free slots first, then the slots of
  the least recently used entries that nobody is loading. The new entries are STORING: lookups
  do not see them and they cannot be evicted. The evicted entries come back in the plan with
  their bytes still in their slots, so the caller can copy them further down before it writes.
  `complete_store(entries, success)` makes the entries READY, or drops them and frees their
  slots: a failed store leaves no entry. With `pin`, READY entries come pinned (a copy further
  down reads them next: write-through), so no store evicts them before that copy's `unpin`.
  Blocks that found no slot (every slot in flight) come back `unplaced`; `wait_for_room(plan, s)`
  waits until the index changed since that plan (a slot freed or an entry evictable again).
- `prepare_load(hashes)` pins the leading READY hits, which leave the LRU order while pinned.
  `unpin(entries)` gives the pins back (also those of `pin_present`, a copy further down); the
  last one puts an entry back as most recently used. Entries that turn evictable together (a
  chain's blocks, stored or unpinned) enter tail first, so a chain's blocks leave tail first.

Events (off unless `enable_events`, which the KV event publisher calls): BlockStored when a store
completes, BlockRemoved when a READY entry leaves (evicted, removed); a failed store, never seen,
sends nothing. Queued under the lock and taken atomically with `take_events`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence

from kvtierd.daemon_key import DaemonKey
from kvtierd.errors import InvalidArgument
from kvtierd.index.classed_lru import ClassedLru
from kvtierd.index.index_events import BlockRemoved, BlockStored, Doorbell, EventQueue, IndexEvent
from kvtierd.index.owner_slots import OwnerSlots
from kvtierd.index.residency import LeaveReason, Residency
from kvtierd.index.slot_entry import BlockMeta, SlotEntry, StorePlan, ready_prefix, tail_first
from kvtierd.retention.tier_retention import TierRetention
from kvtierd.token_bytes import TokenBytes


class SlotIndex:
    """hash → slot for `num_slots` slots, least recently used first.

    Invariants (tests/index/test_slot_index_stateful.py checks each after every step):
    - every slot is either free or held by exactly one entry, so at most `num_slots` entries;
    - each entry is either STORING or READY, and only READY entries are pinned;
    - `_lru` holds exactly the READY entries with no load in flight (the evictable ones), oldest
      first; eviction takes its head; a completed store (unless pinned) and an entry's last unpin
      append to it, a chain's blocks in a batch tail first, so a chain's blocks leave tail first;
    - an entry that is STORING or pinned is never evicted and its slot never handed out;
    - lookups (`lookup`, `metas`, `in`, `prepare_load`, `pin_present`) see READY entries only, so
      a store in progress is invisible until it completes, and a failed store leaves no entry;
    - with owner quotas, `num_slots_of(owner)` equals a recount of the owner's entries (STORING
      ones included), and a store never takes an owner past its limit (an owner above a lowered
      limit, or after a restore, keeps its count while it recycles its own slots).
    """

    def __init__(self, num_slots: int, clock: Callable[[], float] = time.monotonic) -> None:
        if num_slots < 0:
            raise InvalidArgument(f"num_slots must be >= 0, got {num_slots}")
        self.num_slots = num_slots
        self._free_slots = list(range(num_slots - 1, -1, -1))  # a stack: slot 0 first
        self._entries: dict[DaemonKey, SlotEntry] = {}
        self._lru = ClassedLru()  # the evictable entries, next victim first (retention classes, then LRU)
        self._clock = clock
        self._lock = threading.Lock()
        self._room = threading.Condition(self._lock)  # notified when a slot frees or an entry turns evictable
        self._num_room_changes = 0  # under the lock: how often that happened
        self.num_evictions = 0
        self.residency = Residency()  # store to removal of READY entries, by why each left (residency.py)
        self.num_uses = 0  # stores and loads asked of the index (under the lock): has it been used lately?
        self._owners = OwnerSlots()  # per-owner quotas (owner_slots.py), off until set_owner_quota
        self._events: EventQueue | None = None  # set by enable_events
        # called (with the lock held: it must not block) when a store had to evict for want of a free
        # slot: a tier whose extent can grow (t1/host_share.py) asks its budget for more
        self.on_evicting: Callable[[], None] | None = None

    # ----------------------------------------------------------------------------- queries

    @property
    def num_used_slots(self) -> int:
        return self.num_slots - len(self._free_slots)

    @property
    def num_ready(self) -> int:
        with self._lock:
            return sum(not entry.storing for entry in self._entries.values())

    def __contains__(self, block_hash: DaemonKey) -> bool:
        with self._lock:
            entry = self._entries.get(block_hash)
            return entry is not None and not entry.storing

    def lookup(self, block_hashes: Sequence[DaemonKey], parent: DaemonKey | None = None,
               token_bytes: TokenBytes | None = None, block_size: int = 0) -> int:
        """How many leading blocks of the chain are READY here (verified like prefix_match).
        Changes nothing."""
        with self._lock:
            return len(ready_prefix(self._entries, block_hashes, parent, token_bytes, block_size))

    def metas(self, block_hashes: Sequence[DaemonKey]) -> list[BlockMeta]:
        """The stored keys of the leading READY entries named (stops at the first absent one)."""
        with self._lock:
            metas = []
            for block_hash in block_hashes:
                entry = self._entries.get(block_hash)
                if entry is None or entry.storing:
                    break
                metas.append(entry.meta)
            return metas

    def entries(self) -> list[SlotEntry]:
        """A snapshot of every entry (for recovery checks, stats and tests)."""
        with self._lock:
            return list(self._entries.values())

    # ----------------------------------------------------------------------------- stores

    def prepare_store(self, blocks: Sequence[BlockMeta]) -> StorePlan:
        """Reserve slots for the blocks not already here, in order, while slots can be found."""
        with self._lock:
            stores: list[SlotEntry] = []
            evicted: list[SlotEntry] = []
            unplaced: list[BlockMeta] = []
            self.num_uses += 1
            num_skipped = 0
            now = self._clock()
            owners = self._owners
            for meta in blocks:
                if meta.block_hash in self._entries:
                    num_skipped += 1
                    continue
                full_owner = owners.full_owner(meta.block_hash)
                if full_owner is not None:  # it recycles one of its own slots
                    victim = owners.oldest_of(full_owner, self._lru.values())
                    if victim is None:
                        num_skipped += 1  # the owner's slots are all in flight
                        owners.num_skips += 1
                        unplaced.append(meta)
                        continue
                    del self._lru[victim.block_hash]
                elif self._free_slots:
                    victim = None
                    slot = self._free_slots.pop()
                elif self._lru:
                    _, victim = self._lru.popitem(last=False)
                    if self.on_evicting is not None:
                        self.on_evicting()
                else:
                    num_skipped += 1  # every slot is in flight
                    unplaced.append(meta)
                    continue
                if victim is not None:
                    self._delete(victim.block_hash)
                    self._removed(victim)
                    evicted.append(victim)
                    self.num_evictions += 1
                    slot = victim.slot
                entry = SlotEntry(meta, slot, last_use_s=now, entered_at_s=now, stored_s=now)
                self._insert(entry)
                stores.append(entry)
            return StorePlan(stores, evicted, num_skipped, unplaced, self._num_room_changes)

    def wait_for_room(self, plan: StorePlan, timeout_s: float) -> bool:
        """Wait, at most `timeout_s`, until a slot was freed or an entry turned evictable since
        `plan` was made (its unplaced blocks may fit now); False when nothing changed. Blocking:
        a mover's thread only."""
        with self._room:
            return self._room.wait_for(lambda: self._num_room_changes != plan.num_room_changes, max(0.0, timeout_s))

    def complete_store(self, entries: Sequence[SlotEntry], success: bool, pin: bool = False) -> None:
        """READY on success (with `pin`: pinned once, out of the LRU order until `unpin`, taken in
        the same step, so no store evicts them in between); otherwise the entries go and their
        slots are free again."""
        with self._lock:
            for entry in entries:
                assert entry.storing and self._entries.get(entry.block_hash) is entry, entry
                if success:
                    entry.storing = False
                    if pin:
                        entry.num_loads += 1
                    if self._events is not None:
                        self._events.put(_stored(entry))  # in chain order: a parent before its children
                else:
                    self._delete(entry.block_hash)
                    self._free_slots.append(entry.slot)
            if success and not pin:
                self._make_evictable(entries)
            if entries and not (success and pin):
                self._room_changed()

    def restore(self, entries: Sequence[tuple[BlockMeta, int, float]],
                stored_s: Mapping[DaemonKey, float] | None = None) -> None:
        """Insert READY entries at given slots (recovery from a persistent index), oldest first;
        `stored_s`: when each was stored (default: its last use)."""
        with self._lock:
            taken = {slot for _, slot, _ in entries}
            num_hashes = len({meta.block_hash for meta, _, _ in entries})
            if (len(taken) != len(entries) or num_hashes != len(entries) or self._entries
                    or any(not 0 <= s < self.num_slots for s in taken)):
                raise InvalidArgument("restore needs an empty index, distinct hashes and distinct slots in range")
            stored_at = stored_s or {}
            for meta, slot, last_use_s in sorted(entries, key=lambda e: e[2]):
                entry = SlotEntry(meta, slot, storing=False, last_use_s=last_use_s, entered_at_s=self._clock(),
                                  stored_s=stored_at.get(meta.block_hash, last_use_s))
                self._insert(entry)
                self._lru[meta.block_hash] = entry
            self._free_slots = [s for s in range(self.num_slots - 1, -1, -1) if s not in taken]

    # ----------------------------------------------------------------------------- loads

    def prepare_load(self, block_hashes: Sequence[DaemonKey], parent: DaemonKey | None = None,
                     token_bytes: TokenBytes | None = None, block_size: int = 0) -> list[SlotEntry]:
        """Pin the leading verified READY hits of the chain; they cannot be evicted until
        unpin. Returns the pinned entries (possibly none)."""
        with self._lock:
            self.num_uses += 1
            hits = ready_prefix(self._entries, block_hashes, parent, token_bytes, block_size)
            now = self._clock()
            for entry in hits:
                if entry.num_loads == 0:
                    del self._lru[entry.block_hash]
                entry.num_loads += 1
                entry.last_use_s = now
            return hits

    def pin_present(self, block_hashes: Sequence[DaemonKey]) -> list[SlotEntry]:
        """Pin every named READY entry, chained or not (a copy further down reads them);
        missing ones are skipped. Unpin with unpin."""
        with self._lock:
            pinned = []
            for block_hash in block_hashes:
                entry = self._entries.get(block_hash)
                if entry is None or entry.storing:
                    continue
                if entry.num_loads == 0:
                    del self._lru[block_hash]
                entry.num_loads += 1
                pinned.append(entry)
            return pinned

    def unpin(self, entries: Sequence[SlotEntry]) -> None:
        """Give back one pin of each entry (taken by prepare_load or pin_present, for a load up or
        a copy further down); the last one puts the entry back in the LRU order as most recent."""
        with self._lock:
            released = []
            for entry in entries:
                assert entry.num_loads > 0 and self._entries.get(entry.block_hash) is entry, entry
                entry.num_loads -= 1
                if entry.num_loads == 0:
                    released.append(entry)
            self._make_evictable(released)  # most recently used
            if released:
                self._room_changed()

    # ----------------------------------------------------------------------------- removal

    def remove(self, block_hashes: Sequence[DaemonKey], reason: LeaveReason = LeaveReason.FLUSHED) -> list[SlotEntry]:
        """Drop the named READY entries that no load pins (a corrupt block, an operator's evict;
        `reason` EXPIRED: older than the tier's age limit). Returns what was dropped; their slots are free."""
        with self._lock:
            removed = []
            for block_hash in block_hashes:
                entry = self._lru.pop(block_hash, None)
                if entry is None:
                    continue
                self._delete(block_hash)
                self._removed(entry, reason)
                self._free_slots.append(entry.slot)
                removed.append(entry)
            if removed:
                self._room_changed()
            return removed

    def evict_lru(self, num_entries: int) -> list[SlotEntry]:
        """Drop up to `num_entries` least recently used entries that nobody loads (watermarks).
        Returns them; their slots are free."""
        with self._lock:
            evicted = self._pop_lru(num_entries)
            if evicted:
                self._room_changed()
            return evicted

    def _pop_lru(self, num_entries: int) -> list[SlotEntry]:
        """Under the lock: drop up to `num_entries` of the least recently used evictable entries,
        counted as evictions, their slots free."""
        evicted = []
        while self._lru and len(evicted) < num_entries:
            _, entry = self._lru.popitem(last=False)
            self._delete(entry.block_hash)
            self._removed(entry)
            self._free_slots.append(entry.slot)
            evicted.append(entry)
        self.num_evictions += len(evicted)
        return evicted

    # ----------------------------------------------------------------------------- events

    def enable_events(self, max_pending: int, doorbell: Doorbell | None = None) -> None:
        """Queue events from now on, at most `max_pending` (the oldest are dropped, counted), ringing
        `doorbell` whenever some wait to be taken (EventQueue); the READY entries already here
        (restored from disk) are queued first, as stored, oldest first."""
        with self._lock:
            if self._events is None:
                self._events = EventQueue(max_pending)
                for entry in self._entries.values():
                    if not entry.storing:
                        self._events.put(_stored(entry))
            if doorbell is not None:
                self._events.set_doorbell(doorbell)

    def take_events(self) -> list[IndexEvent]:
        """Every event since the last call, atomically; empty unless events were enabled."""
        with self._lock:
            return self._events.take() if self._events is not None else []

    @property
    def num_dropped_events(self) -> int:
        return self._events.num_dropped if self._events is not None else 0

    def _removed(self, entry: SlotEntry, reason: LeaveReason | None = None) -> None:
        """A READY entry left (`reason` None: for room, the residency's classify says why)."""
        if entry.storing:
            return
        self.residency.left(entry.block_hash, self._clock() - entry.entered_at_s, reason)
        if self._events is not None:
            self._events.put(BlockRemoved(entry.block_hash))

    # ----------------------------------------------------------------------------- retention

    def set_eviction(self, name: str) -> None:
        """Entries without a live hint leave in the order called `name` ("lru" | "s3fifo":
        eviction_order.py); the evictable ones move over, next victim first."""
        with self._lock:
            self._lru.set_eviction(name)

    def set_retention(self, retention: TierRetention) -> None:
        """Evict by retention class, then LRU (classed_lru.py); set once, before any hint."""
        with self._lock:
            self._lru.set_retention(retention)

    def reclassify(self, block_hashes: Sequence[DaemonKey]) -> None:
        """The retention hints of these blocks changed (a HintTable listener)."""
        with self._lock:
            self._lru.reclassify(block_hashes)

    @property
    def retention(self) -> TierRetention | None:
        return self._lru.retention

    # ----------------------------------------------------------------------------- owners

    def set_owner_quota(self, owner_of: Callable[[DaemonKey], bytes],
                        max_slots_of: Callable[[bytes], int | None]) -> None:
        """Limit the slots each owner (a tenant: `owner_of(block_hash)`) may hold to
        `max_slots_of(owner)` (None = no limit). An owner at its limit stores a new block in the slot
        of its own least recently used entry; with none evictable, the block is not stored."""
        with self._lock:
            self._owners.limit_by(owner_of, max_slots_of, self._entries)

    def num_slots_of(self, owner: bytes) -> int:
        with self._lock:
            return self._owners.count(owner)

    @property
    def num_quota_skips(self) -> int:
        """Blocks not stored: their owner was at its limit with nothing evictable."""
        return self._owners.num_skips

    def _make_evictable(self, entries: Sequence[SlotEntry]) -> None:
        """Append entries that turned evictable together, a chain's blocks tail first (slot_entry.tail_first):
        a lookup only hits a chain's leading blocks, so its tail is what should go first (as vLLM's
        block pool frees a request's blocks), and a chain demoted piecemeal keeps its prefix above."""
        for entry in tail_first(entries):
            self._lru[entry.block_hash] = entry

    def _room_changed(self) -> None:
        """A slot was freed or an entry turned evictable (the lock held): wake `wait_for_room`."""
        self._num_room_changes += 1
        self._room.notify_all()

    def _insert(self, entry: SlotEntry) -> None:
        self._entries[entry.block_hash] = entry
        self._owners.added(entry.block_hash)

    def _delete(self, block_hash: DaemonKey) -> None:
        del self._entries[block_hash]
        self._lru.forget(block_hash)  # its eviction order's history of it goes too
        self._owners.removed(block_hash)


def _stored(entry: SlotEntry) -> BlockStored:
    return BlockStored(entry.block_hash, entry.meta.parent_hash, entry.slot, entry.meta.token_ids)

