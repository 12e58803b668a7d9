"""Random prepare/complete stores, loads, pins, removals, LRU evictions and restores of a
SlotIndex, against a reference model (a dict of entries and a list in LRU order, which a chain's
blocks turning evictable together enter tail first), with the invariants of slot_index.py checked after each step."""

from __future__ import annotations

from collections import Counter

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvtierd.errors import InvalidArgument
from kvtierd.index.slot_entry import BlockMeta
from kvtierd.index.slot_index import SlotIndex
from tests.factories import FakeClock

NUM_SLOTS = 4
ROOT = b"\xff" * 32
OWNERS = [b"\x00", b"\x01"]


def block_hash(i: int) -> bytes:
    return bytes([i]) * 32


def owner_of(h: bytes) -> bytes:
    """Blocks alternate between the two owners."""
    return bytes([h[0] % 2])


# Two chains of four blocks (0-3 and 4-7): twice the slots, so stores must evict.
METAS = {block_hash(i): BlockMeta(block_hash(i), ROOT if i % 4 == 0 else block_hash(i - 1), bytes([i]) * 16)
         for i in range(8)}
HASHES = sorted(METAS)
hash_lists = st.lists(st.sampled_from(HASHES), max_size=5)


def tail_first(hashes: list[bytes]) -> list[bytes]:
    """The order a batch turning evictable enters the LRU list in: each stretch of a chain given head
    first (every block's parent just before it) reversed, the rest as given."""
    runs: list[list[bytes]] = []
    for h in hashes:
        if runs and METAS[h].parent_hash == runs[-1][-1]:
            runs[-1].append(h)
        else:
            runs.append([h])
    return [h for run in runs for h in reversed(run)]


class SlotIndexMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.index = SlotIndex(NUM_SLOTS, self.clock)
        # the model
        self.storing: dict[bytes, int] = {}  # hash → slot, reserved and not yet complete
        self.ready: dict[bytes, int] = {}  # hash → slot
        self.num_pins: Counter[bytes] = Counter()  # READY hashes pinned by loads in flight
        self.lru: list[bytes] = []  # the READY unpinned hashes, least recently used first
        self.plans = []  # store plans not yet completed
        self.pins = []  # pinned entry lists not yet unpinned
        self.limits: dict[bytes, int | None] = {}  # owner → max slots, when quotas are on
        self.caps: dict[bytes, int] = {}  # owner → most slots it may hold now (a lowered limit waits for recycling)
        self.num_evictions = self.num_quota_skips = 0

    # ------------------------------------------------------------------ set-up

    @initialize(restored=st.lists(st.tuples(st.sampled_from(HASHES), st.integers(0, NUM_SLOTS - 1),
                                            st.integers(0, 50)), max_size=NUM_SLOTS + 1))
    def restore(self, restored):
        """Recovery from a persistent index: READY entries at given slots, oldest first."""
        entries = [(METAS[h], slot, float(t)) for h, slot, t in restored]
        distinct = (len({slot for _, slot, _ in restored}) == len(restored)
                    and len({h for h, _, _ in restored}) == len(restored))
        try:
            self.index.restore(entries)
        except InvalidArgument:
            assert not distinct
            return
        assert distinct, "restore took two entries for one slot or one hash"
        for h, slot, _ in sorted(restored, key=lambda e: e[2]):
            self.ready[h] = slot
            self.lru.append(h)
        counts = self.count_by_owner()  # recovery does not enforce a limit: recycling does
        self.caps = {o: max(cap, counts[o]) for o, cap in self.caps.items()}

    @initialize(limits=st.none() | st.tuples(st.none() | st.integers(0, 3), st.none() | st.integers(0, 3)))
    def quotas(self, limits):
        if limits is not None:
            self.set_limits(limits)

    def set_limits(self, limits) -> None:
        self.limits = dict(zip(OWNERS, limits))
        self.index.set_owner_quota(owner_of, self.limits.get)
        counts = self.count_by_owner()
        self.caps = {o: max(limit, counts[o]) for o, limit in self.limits.items() if limit is not None}

    # ------------------------------------------------------------------ stores

    @rule(hashes=hash_lists)
    def prepare_store(self, hashes):
        expected_stores, expected_evicted, num_skipped = [], [], 0
        num_free = NUM_SLOTS - len(self.storing) - len(self.ready)
        for h in hashes:
            if h in self.storing or h in self.ready:
                num_skipped += 1
                continue
            limit = self.limits.get(owner_of(h))
            if limit is not None and self.count_by_owner()[owner_of(h)] >= limit:
                victim = next((v for v in self.lru if owner_of(v) == owner_of(h)), None)
                if victim is None:
                    num_skipped += 1
                    self.num_quota_skips += 1
                    continue
            elif num_free:
                victim = None
                num_free -= 1
            elif self.lru:
                victim = self.lru[0]
            else:
                num_skipped += 1
                continue
            slot = None
            if victim is not None:
                self.lru.remove(victim)
                slot = self.ready.pop(victim)
                expected_evicted.append((victim, slot))
                self.num_evictions += 1
            expected_stores.append((h, slot))
            self.storing[h] = -1  # the slot is checked below
        plan = self.index.prepare_store([METAS[h] for h in hashes])
        assert [(e.block_hash, e.slot) for e in plan.evicted] == expected_evicted, "not the LRU victims"
        assert [e.block_hash for e in plan.stores] == [h for h, _ in expected_stores]
        assert plan.num_skipped == num_skipped
        held = set(self.storing.values()) | set(self.ready.values())
        for entry, (h, victim_slot) in zip(plan.stores, expected_stores):
            assert entry.storing and entry.num_loads == 0
            if victim_slot is not None:
                assert entry.slot == victim_slot, "a store must reuse the slot of the entry it evicted"
            else:
                assert entry.slot not in held, "a free slot was held"
            held.add(entry.slot)
            self.storing[h] = entry.slot
        if plan.stores:
            self.plans.append(plan.stores)
        self.clock.advance(1)

    @precondition(lambda self: self.plans)
    @rule(data=st.data(), success=st.booleans())
    def complete_store(self, data, success):
        entries = self.plans.pop(data.draw(st.integers(0, len(self.plans) - 1)))
        num_used = self.index.num_used_slots
        self.index.complete_store(entries, success)
        for entry in entries:
            slot = self.storing.pop(entry.block_hash)
            if success:
                self.ready[entry.block_hash] = slot
        if success:
            self.lru.extend(tail_first([e.block_hash for e in entries]))
        if not success:  # a failed store leaves nothing: no entry, its slots free again
            assert self.index.num_used_slots == num_used - len(entries)
            assert not {e.block_hash for e in entries} & {e.block_hash for e in self.index.entries()}

    # ------------------------------------------------------------------ loads

    @rule(hashes=hash_lists, parent=st.sampled_from([None, ROOT]))
    def prepare_load(self, hashes, parent):
        expected = self.ready_prefix(hashes, parent)
        pinned = self.index.prepare_load(hashes, parent)
        assert [e.block_hash for e in pinned] == expected
        self.pin(expected, pinned)
        for entry in pinned:
            assert entry.last_use_s == self.clock()
        self.clock.advance(1)

    @rule(hashes=hash_lists)
    def pin_present(self, hashes):
        expected = [h for h in hashes if h in self.ready]
        pinned = self.index.pin_present(hashes)
        assert [e.block_hash for e in pinned] == expected
        self.pin(expected, pinned)

    def pin(self, expected, pinned) -> None:
        for h in expected:
            if self.num_pins[h] == 0:
                self.lru.remove(h)
            self.num_pins[h] += 1
        if pinned:
            self.pins.append(pinned)

    @precondition(lambda self: self.pins)
    @rule(data=st.data())
    def unpin(self, data):
        entries = self.pins.pop(data.draw(st.integers(0, len(self.pins) - 1)))
        self.index.unpin(entries)
        released = []
        for entry in entries:
            self.num_pins[entry.block_hash] -= 1
            if self.num_pins[entry.block_hash] == 0:
                del self.num_pins[entry.block_hash]
                released.append(entry.block_hash)
        self.lru.extend(tail_first(released))  # the last unpins: most recently used
        self.clock.advance(1)

    # ------------------------------------------------------------------ removal

    @rule(hashes=hash_lists)
    def remove(self, hashes):
        expected = []
        for h in hashes:
            if h in self.lru:
                self.lru.remove(h)
                del self.ready[h]
                expected.append(h)
        assert [e.block_hash for e in self.index.remove(hashes)] == expected

    @rule(num_entries=st.integers(0, NUM_SLOTS + 1))
    def evict_lru(self, num_entries):
        expected, self.lru = self.lru[:num_entries], self.lru[num_entries:]
        for h in expected:
            del self.ready[h]
        self.num_evictions += len(expected)
        assert [e.block_hash for e in self.index.evict_lru(num_entries)] == expected, "not LRU order"

    @precondition(lambda self: self.limits)
    @rule(limits=st.tuples(st.none() | st.integers(0, 3), st.none() | st.integers(0, 3)))
    def change_quotas(self, limits):
        self.set_limits(limits)

    # ------------------------------------------------------------------ invariants

    @invariant()
    def each_slot_is_free_or_held_by_exactly_one_entry(self):
        entries = self.index.entries()
        slots = [e.slot for e in entries]
        assert len(slots) == len(set(slots)) and all(0 <= s < NUM_SLOTS for s in slots)
        assert len(entries) == self.index.num_used_slots <= NUM_SLOTS  # capacity never exceeded

    @invariant()
    def each_entry_is_in_exactly_the_state_of_the_model(self):
        entries = {e.block_hash: e for e in self.index.entries()}
        assert entries.keys() == self.storing.keys() | self.ready.keys()
        assert not self.storing.keys() & self.ready.keys()
        for h, entry in entries.items():
            assert entry.storing == (h in self.storing)
            assert entry.slot == (self.storing.get(h) if entry.storing else self.ready[h])
            assert entry.num_loads == self.num_pins[h]
            assert not (entry.storing and entry.num_loads), "a STORING entry was pinned"
        assert sorted(self.lru) == sorted(h for h in self.ready if not self.num_pins[h])
        assert self.index.num_ready == len(self.ready)

    @invariant()
    def a_store_in_progress_is_invisible(self):
        for h in HASHES:
            assert (h in self.index) == (h in self.ready)
            assert self.index.lookup([h]) == (h in self.ready)
            assert [m.block_hash for m in self.index.metas([h])] == ([h] if h in self.ready else [])

    @invariant()
    def per_owner_counts_equal_a_recount(self):
        if not self.limits:
            return
        counts = self.count_by_owner()
        for owner in OWNERS:
            assert self.index.num_slots_of(owner) == counts[owner]
            if owner in self.caps:
                assert counts[owner] <= self.caps[owner], "an owner holds more slots than its limit"
                self.caps[owner] = max(self.limits[owner], min(self.caps[owner], counts[owner]))

    @invariant()
    def counters_match(self):
        assert self.index.num_evictions == self.num_evictions
        assert self.index.num_quota_skips == self.num_quota_skips

    def teardown(self):
        """Everything in flight completes: every slot can then be evicted."""
        for entries in self.plans:
            self.index.complete_store(entries, True)
        for entries in self.pins:
            self.index.unpin(entries)
        self.index.evict_lru(NUM_SLOTS)
        assert self.index.entries() == [] and self.index.num_used_slots == 0

    # ------------------------------------------------------------------ model helpers

    def count_by_owner(self) -> Counter[bytes]:
        return Counter(owner_of(h) for h in [*self.storing, *self.ready])

    def ready_prefix(self, hashes, parent) -> list[bytes]:
        hits = []
        for h in hashes:
            if h not in self.ready or (parent is not None and METAS[h].parent_hash != parent):
                break
            hits.append(h)
            parent = h  # block 0's parent is checked only against a given root; the rest chain
        return hits


TestSlotIndexStateMachine = SlotIndexMachine.TestCase
TestSlotIndexStateMachine.settings = settings(stateful_step_count=50)
