"""The slot index of the lower tiers: two-phase stores and loads, LRU eviction, protection."""

from __future__ import annotations

import pytest

from kvtierd.errors import InvalidArgument
from kvtierd.index.slot_entry import BlockMeta, SlotEntry, tail_first
from kvtierd.index.slot_index import SlotIndex
from tests.factories import FakeClock


def chain(n: int, start: int = 0) -> list[BlockMeta]:
    """n chained blocks with distinct fake hashes (32 bytes) and 4 tokens each."""
    metas, parent = [], b"\x00" * 32
    for i in range(start, start + n):
        block_hash = i.to_bytes(4, "little") * 8
        metas.append(BlockMeta(block_hash, parent, bytes([i % 256]) * 16))
        parent = block_hash
    return metas


def store(index: SlotIndex, metas: list[BlockMeta], success: bool = True):
    plan = index.prepare_store(metas)
    index.complete_store(plan.stores, success)
    return plan


def hashes(metas):
    return [m.block_hash for m in metas]


def test_stores_take_free_slots_and_become_visible_only_when_complete():
    index = SlotIndex(4)
    metas = chain(3)
    plan = index.prepare_store(metas)
    assert [e.slot for e in plan.stores] == [0, 1, 2] and plan.evicted == [] and plan.num_skipped == 0
    assert index.lookup(hashes(metas)) == 0  # STORING is invisible
    index.complete_store(plan.stores, success=True)
    assert index.lookup(hashes(metas)) == 3 and index.num_used_slots == 3


def test_a_failed_store_leaves_no_entry_and_frees_its_slots():
    index = SlotIndex(4)
    store(index, chain(3), success=False)
    assert index.entries() == [] and index.num_used_slots == 0
    assert sorted(e.slot for e in index.prepare_store(chain(4)).stores) == [0, 1, 2, 3]  # all usable again


def test_blocks_already_present_are_skipped():
    index = SlotIndex(8)
    store(index, chain(3))
    plan = index.prepare_store(chain(5))
    assert plan.num_skipped == 3 and len(plan.stores) == 2


def test_eviction_takes_the_least_recently_used_and_returns_its_bytes_location():
    clock = FakeClock()
    index = SlotIndex(3, clock)
    metas = chain(3)
    store(index, metas)
    clock.advance(1)
    pinned = index.prepare_load(hashes(metas[2:]))  # block 2, the oldest (stored tail first), becomes the newest
    index.unpin(pinned)
    plan = index.prepare_store(chain(1, start=10))
    assert [e.block_hash for e in plan.evicted] == [metas[1].block_hash]
    assert plan.stores[0].slot == plan.evicted[0].slot
    assert index.num_evictions == 1


def test_a_chain_stored_or_unpinned_together_leaves_tail_first():
    """A lookup hits only a chain's leading blocks, so a batch that turns evictable together (a
    completed store, an unpin) enters the LRU order tail first; stored events stay in chain order."""
    index = SlotIndex(4)
    index.enable_events(16)
    metas = chain(4)
    store(index, metas)
    assert [e.block_hash for e in index.take_events()] == hashes(metas)  # a parent before its children
    assert [e.block_hash for e in index.evict_lru(1)] == [metas[3].block_hash]
    assert index.lookup(hashes(metas)) == 3  # the prefix that is left still hits
    pinned = index.prepare_load(hashes(metas[:3]))
    index.unpin(index.pin_present(hashes(metas[:1])))  # a pin that is not the last: nothing moves yet
    index.unpin(pinned)
    assert [e.block_hash for e in index.evict_lru(3)] == hashes(metas[:3])[::-1]


def test_a_batch_given_tail_first_or_unchained_enters_as_given():
    """A tier's victims come tail first already (T0's free queue, T1's LRU) and stay so; blocks of no
    chain keep their order."""
    index = SlotIndex(8)
    metas = chain(4)
    store(index, metas[::-1])  # as T0 evicts a request's blocks
    unchained = [chain(1, start=i)[0] for i in (20, 21, 22)]  # each a root block
    store(index, unchained)
    assert [e.block_hash for e in index.evict_lru(7)] == hashes(metas[::-1]) + hashes(unchained)


def test_tail_first_reverses_each_chain_given_head_first():
    a, b = [SlotEntry(m, slot=0) for m in chain(3, start=1)], [SlotEntry(m, slot=0) for m in chain(2, start=10)]
    assert tail_first(a + b) == a[::-1] + b[::-1]  # two requests' chains, each head first
    assert tail_first(a[::-1] + b) == a[::-1] + b[::-1]


def test_a_pinned_entry_is_never_evicted():
    index = SlotIndex(2)
    metas = chain(2)
    store(index, metas)
    pinned = index.prepare_load(hashes(metas))
    plan = index.prepare_store(chain(2, start=10))
    assert plan.stores == [] and plan.evicted == [] and plan.num_skipped == 2
    index.unpin(pinned)
    assert len(index.prepare_store(chain(2, start=10)).stores) == 2


def test_a_storing_entry_is_never_evicted():
    index = SlotIndex(2)
    first = index.prepare_store(chain(2))
    second = index.prepare_store(chain(2, start=10))
    assert second.stores == [] and second.num_skipped == 2
    index.complete_store(first.stores, True)


def test_loads_pin_only_the_leading_verified_hits():
    index = SlotIndex(8)
    metas = chain(4)
    store(index, metas)
    token_bytes = b"".join(m.token_ids for m in metas)
    assert index.lookup(hashes(metas), parent=b"\x00" * 32, token_bytes=token_bytes, block_size=4) == 4
    forged = bytearray(token_bytes)
    forged[2 * 16] ^= 1
    assert index.lookup(hashes(metas), token_bytes=bytes(forged), block_size=4) == 2
    assert index.lookup(hashes(metas), parent=b"\x01" * 32) == 0
    assert index.lookup([metas[0].block_hash, metas[2].block_hash]) == 1  # block 2's parent is block 1
    assert len(index.prepare_load(hashes(metas), parent=b"\x00" * 32)) == 4


def test_remove_drops_ready_unpinned_entries_only():
    index = SlotIndex(4)
    metas = chain(3)
    store(index, metas)
    pinned = index.prepare_load(hashes(metas[:1]))
    removed = index.remove(hashes(metas) + [b"\x09" * 32])
    assert [e.block_hash for e in removed] == hashes(metas[1:])
    assert index.lookup(hashes(metas)) == 1 and index.num_used_slots == 1
    index.unpin(pinned)


def test_restore_rebuilds_entries_and_free_slots():
    index = SlotIndex(4)
    metas = chain(2)
    index.restore([(metas[0], 3, 5.0), (metas[1], 1, 2.0)])
    assert index.lookup(hashes(metas)) == 2 and index.num_used_slots == 2
    plan = index.prepare_store(chain(3, start=10))
    assert [e.slot for e in plan.stores] == [0, 2, 1]  # the two free slots, then the evicted one
    assert [e.block_hash for e in plan.evicted] == [metas[1].block_hash]  # the older one goes first
    assert plan.evicted[0].block_hash == metas[1].block_hash  # the older one goes first
    with pytest.raises(InvalidArgument):
        SlotIndex(2).restore([(metas[0], 0, 0.0), (metas[1], 0, 0.0)])


def test_evict_lru_drops_oldest_unpinned_first():
    clock = FakeClock()
    index = SlotIndex(4, clock)
    metas = chain(4)
    for meta in metas:
        store(index, [meta])
        clock.advance(1)
    pinned = index.prepare_load(hashes(metas[:1]))
    evicted = index.evict_lru(2)
    assert [e.block_hash for e in evicted] == hashes(metas[1:3])
    assert index.num_used_slots == 2 and index.num_evictions == 2
    index.unpin(pinned)


def test_pin_present_pins_unchained_entries_and_skips_missing():
    index = SlotIndex(4)
    metas = chain(4)
    store(index, metas)
    pinned = index.pin_present([metas[3].block_hash, b"\x09" * 32, metas[1].block_hash])
    assert [e.block_hash for e in pinned] == [metas[3].block_hash, metas[1].block_hash]
    # the rest leave tail first, as they were stored
    assert [e.block_hash for e in index.evict_lru(4)] == [metas[2].block_hash, metas[0].block_hash]
    index.unpin(pinned)
    assert index.num_used_slots == 2


def test_metas_returns_the_stored_keys_of_the_leading_entries():
    index = SlotIndex(4)
    metas = chain(3)
    store(index, metas[:2])
    assert index.metas(hashes(metas)) == metas[:2]
    assert index.metas([metas[1].block_hash]) == [metas[1]]


def owned(owner: bytes, metas: list[BlockMeta]) -> list[BlockMeta]:
    """The same chain under keys that start with `owner` (a tenant tag)."""
    return [BlockMeta(owner + m.block_hash, owner + m.parent_hash, m.token_ids) for m in metas]


def test_an_owner_at_its_limit_recycles_its_own_oldest_slot_not_another_owners():
    """Owner a may hold 2 slots: its third block evicts a's least recently used, never b's."""
    clock = FakeClock()
    index = SlotIndex(6, clock=clock)
    index.set_owner_quota(lambda key: key[:1], {b"a": 2}.get)
    a, b = owned(b"a", chain(3)), owned(b"b", chain(3, start=10))
    store(index, b[:1])
    clock.advance(1)
    store(index, a[:2])
    clock.advance(1)
    store(index, b[1:])
    clock.advance(1)
    plan = store(index, a[2:])
    # a's least recently used (its chain stored tail first: a[1]), though b[0] is older
    assert [e.block_hash for e in plan.evicted] == [a[1].block_hash]
    assert index.num_slots_of(b"a") == 2 and index.num_slots_of(b"b") == 3
    assert index.lookup(hashes(b)) == 3
    assert a[0].block_hash in index and a[2].block_hash in index and a[1].block_hash not in index


def test_an_owner_at_its_limit_with_every_slot_pinned_stores_nothing():
    index = SlotIndex(6)
    index.set_owner_quota(lambda key: key[:1], lambda owner: 1 if owner == b"a" else None)
    a = owned(b"a", chain(2))
    store(index, a[:1])
    pinned = index.prepare_load([a[0].block_hash])
    plan = store(index, a[1:])
    assert plan.stores == [] and plan.num_skipped == 1 and index.num_quota_skips == 1
    index.unpin(pinned)
    assert [e.block_hash for e in store(index, a[1:]).evicted] == [a[0].block_hash]


def test_owner_counts_follow_every_removal_and_a_zero_limit_stores_nothing():
    index = SlotIndex(8)
    a = owned(b"a", chain(4))
    store(index, a)
    index.set_owner_quota(lambda key: key[:1], {b"a": 8, b"z": 0}.get)  # counts what is already there
    assert index.num_slots_of(b"a") == 4
    index.remove([a[0].block_hash])
    index.evict_lru(1)
    failed = index.prepare_store(owned(b"a", chain(1, start=20)))
    index.complete_store(failed.stores, success=False)
    assert index.num_slots_of(b"a") == 2
    assert store(index, owned(b"z", chain(1))).stores == []


def test_events_are_off_until_enabled_then_stored_on_completion_and_removed_when_a_ready_entry_leaves():
    """Per hash, strictly stored then removed: a failed store says nothing, an eviction or removal
    of a READY entry says removed, and the entries already there are announced on enabling."""
    from kvtierd.index.index_events import BlockRemoved, BlockStored

    index = SlotIndex(3)
    metas = chain(6)
    store(index, metas[:1])
    assert index.take_events() == []  # off
    index.enable_events(max_pending=100)
    assert index.take_events() == [BlockStored(metas[0].block_hash, metas[0].parent_hash, 0, metas[0].token_ids)]
    store(index, metas[1:2], success=False)  # never visible: no event
    store(index, metas[1:3])
    assert index.take_events() == [BlockStored(m.block_hash, m.parent_hash, slot, m.token_ids)
                                   for m, slot in zip(metas[1:3], (1, 2))]
    store(index, metas[3:4])  # full: the least recently used (metas[0]) makes room
    assert index.take_events() == [BlockRemoved(metas[0].block_hash),
                                   BlockStored(metas[3].block_hash, metas[3].parent_hash, 0, metas[3].token_ids)]
    pinned = index.prepare_load(hashes(metas[1:2]))
    assert hashes(e.meta for e in index.remove(hashes(metas[1:3]))) == [metas[2].block_hash]
    assert index.take_events() == [BlockRemoved(metas[2].block_hash)]  # metas[1] is pinned: it stays
    index.unpin(pinned)
    index.evict_lru(5)
    assert sorted(index.take_events(), key=lambda e: e.block_hash) == sorted(
        [BlockRemoved(metas[1].block_hash), BlockRemoved(metas[3].block_hash)], key=lambda e: e.block_hash)
    assert index.take_events() == []


def test_event_queue_is_bounded_and_counts_what_it_dropped():
    index = SlotIndex(8)
    index.enable_events(max_pending=3)
    store(index, chain(5))
    assert [e.block_id for e in index.take_events()] == [2, 3, 4] and index.num_dropped_events == 2


def test_enabled_events_ring_the_doorbell_once_per_batch_between_takes():
    """Entries restored before enabling ring at once; a store's events ring once until taken; a failed store, never."""
    index = SlotIndex(4)
    metas = chain(4)
    store(index, metas[:1])
    rings = []
    index.enable_events(max_pending=100, doorbell=lambda: rings.append(len(rings)))
    assert rings == [0]
    store(index, metas[1:3])
    assert rings == [0] and len(index.take_events()) == 3
    store(index, metas[3:4], success=False)
    assert rings == [0]
    store(index, metas[3:4])
    assert rings == [0, 1]
