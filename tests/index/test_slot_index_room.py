"""Room in a slot index for write-through: a store completed pinned is never evicted before its
unpin, blocks without a slot come back unplaced, and wait_for_room wakes on the change that
could give them one (and only then)."""

from __future__ import annotations

import threading

from kvtierd.index.slot_index import SlotIndex
from tests.index.test_slot_index import chain, hashes


def test_a_store_completed_pinned_is_not_evicted_until_unpinned():
    index = SlotIndex(2)
    first = index.prepare_store(chain(2))
    index.complete_store(first.stores, success=True, pin=True)
    assert index.lookup(hashes(chain(2))) == 2  # visible at once
    later = index.prepare_store(chain(2, start=10))
    assert later.stores == [] and later.evicted == [] and hashes(later.unplaced) == hashes(chain(2, start=10))
    assert index.evict_lru(2) == []
    index.unpin(first.stores)
    again = index.prepare_store(later.unplaced)
    assert hashes(again.evicted) == hashes(chain(2))[::-1] and again.unplaced == []  # unpinned: tail first


def test_unplaced_are_only_the_blocks_without_a_slot():
    index = SlotIndex(3)
    plan = index.prepare_store(chain(2))
    metas = chain(5)  # 2 being stored (skipped, not unplaced), 1 free slot, 2 without one
    second = index.prepare_store(metas)
    assert hashes(e.meta for e in second.stores) == hashes(metas[2:3])
    assert hashes(second.unplaced) == hashes(metas[3:]) and second.num_skipped == 4
    index.complete_store(plan.stores + second.stores, success=True)


def test_wait_for_room_wakes_on_the_last_unpin_and_not_before():
    index = SlotIndex(1)
    first = index.prepare_store(chain(1))
    index.complete_store(first.stores, success=True, pin=True)
    blocked = index.prepare_store(chain(1, start=5))
    assert blocked.unplaced and not index.wait_for_room(blocked, 0.0)
    loaded = index.prepare_load(hashes(chain(1)))  # a second pin (a load): one unpin leaves the entry pinned
    index.unpin(loaded)
    assert not index.wait_for_room(blocked, 0.0)
    woke = []
    waiter = threading.Thread(target=lambda: woke.append(index.wait_for_room(blocked, 60)))
    waiter.start()
    index.unpin(first.stores)  # the last pin: evictable again
    waiter.join(60)
    assert woke == [True]
    assert len(index.prepare_store(blocked.unplaced).stores) == 1
