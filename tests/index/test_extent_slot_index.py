"""A slot index over a growing and shrinking extent: a shrink evicts the least recently used entries
wherever they lie, moves the kept ones out of the end (invisible while they move), never moves or
drops one a load or a store holds, and leaves every slot of the extent free or held exactly once."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvtierd.index.extent_slot_index import ExtentSlotIndex
from kvtierd.index.slot_entry import BlockMeta


def meta(i: int) -> BlockMeta:
    return BlockMeta(i.to_bytes(4, "little") * 8, b"\0" * 32, b"")


def filled(num_slots: int, num_entries: int) -> ExtentSlotIndex:
    """An index of `num_slots` slots holding entries 0..num_entries-1, entry i stored i-th (0 least recent)."""
    clock = iter(range(10_000))
    index = ExtentSlotIndex(num_slots, num_slots, clock=lambda: float(next(clock)))
    for i in range(num_entries):
        plan = index.prepare_store([meta(i)])
        index.complete_store(plan.stores, success=True)
    return index


def check_slots(index: ExtentSlotIndex) -> None:
    held = [e.slot for e in index.entries()]
    assert len(held) == len(set(held)) and all(0 <= s < index.num_slots for s in held)
    assert sorted(held + index._free_slots) == list(range(index.num_slots))


def test_a_shrink_evicts_the_least_recently_used_and_moves_the_rest_below_the_new_end():
    index = filled(8, 8)  # entry i in slot i
    shrink = index.plan_shrink(4)
    assert index.num_slots == 4 and [e.meta for e in shrink.evicted] == [meta(i) for i in range(4)]
    moved = {e.meta: (old, new) for e, old, new in shrink.moves}
    assert {m: old for m, (old, _) in moved.items()} == {meta(i): i for i in range(4, 8)}
    assert sorted(new for _, new in moved.values()) == [0, 1, 2, 3]
    assert index.lookup([meta(5).block_hash]) == 0  # invisible while its bytes move
    index.finish_shrink(shrink, moved=True)
    assert index.lookup([meta(5).block_hash]) == 1 and index.num_evictions == 4
    check_slots(index)


def test_a_block_a_load_holds_is_never_moved_and_the_shrink_stops_above_it():
    index = filled(8, 8)
    pinned = index.prepare_load([meta(6).block_hash])
    shrink = index.plan_shrink(2, grain=4)
    assert index.num_slots == 8  # slot 6 is held: rounded up to the grain, nothing can go
    assert not shrink.moves and not shrink.evicted
    index.unpin(pinned)
    shrink = index.plan_shrink(2, grain=4)
    assert index.num_slots == 4 and [e.meta for e in shrink.evicted] == [meta(i) for i in range(4)]
    assert sorted(old for _, old, _ in shrink.moves) == [4, 5, 6, 7]  # the kept four, all past the new end
    index.finish_shrink(shrink, moved=True)
    assert meta(6).block_hash in {e.block_hash for e in index.entries()}  # just unpinned: most recent, kept
    check_slots(index)


def test_a_move_that_failed_drops_the_moved_blocks():
    index = filled(6, 6)
    shrink = index.plan_shrink(3)
    index.finish_shrink(shrink, moved=False)
    assert index.entries() == [] and index.num_evictions == 6
    check_slots(index)


def test_moves_that_failed_one_by_one_drop_only_those_blocks_and_free_their_new_slots():
    """A disk copy reports each move (T2: a read that did not verify): the failed ones go, counted
    as evictions, the others live at their new slots, and waiters see the room."""
    index = filled(8, 8)  # entry i in slot i
    shrink = index.plan_shrink(4)
    moved_to = {e.meta: new for e, _, new in shrink.moves}
    room_changes = index._num_room_changes
    landed = [e.meta != meta(5) for e, _, _ in shrink.moves]
    index.finish_shrink(shrink, landed)
    assert {e.meta: e.slot for e in index.entries()} == {m: s for m, s in moved_to.items() if m != meta(5)}
    assert index.lookup([meta(5).block_hash]) == 0 and index.num_evictions == 5
    assert moved_to[meta(5)] in index._free_slots and index._num_room_changes > room_changes
    check_slots(index)


@given(num_slots=st.integers(1, 24), data=st.data())
def test_any_shrink_keeps_the_most_recent_blocks_that_fit_and_every_slot_accounted(num_slots, data):
    num_entries = data.draw(st.integers(0, num_slots))
    index = filled(num_slots, num_entries)
    for i in data.draw(st.lists(st.integers(0, max(0, num_entries - 1)), max_size=5)) if num_entries else []:
        index.unpin(index.prepare_load([meta(i).block_hash]))  # used again: most recent
    order = [e.meta for e in sorted(index.entries(), key=lambda e: e.last_use_s)]
    target = data.draw(st.integers(0, num_slots))
    shrink = index.plan_shrink(target)
    index.finish_shrink(shrink, moved=True)
    assert index.num_slots == target
    kept = {e.meta for e in index.entries()}
    assert kept == set(order[len(order) - min(len(order), target):])
    check_slots(index)
    assert index.num_used_slots == len(kept)


def test_blocks_moved_by_a_shrink_keep_their_eviction_order_a_chain_tail_first():
    """The moved entries re-enter the LRU order as they stood in it: a chain stored together still
    leaves tail first after a shrink moved it."""
    index = filled(8, 4)  # entries 0..3 in slots 0..3, the least recent
    chained = [BlockMeta(meta(i).block_hash, meta(i - 1).block_hash, b"") for i in range(4, 8)]
    plan = index.prepare_store(chained)  # one chain, head first, in slots 4..7
    index.complete_store(plan.stores, success=True)
    shrink = index.plan_shrink(4)
    assert [e.meta for e in shrink.evicted] == [meta(i) for i in range(4)]
    index.finish_shrink(shrink, moved=True)
    assert [e.meta for e in index.evict_lru(4)] == chained[::-1]
    check_slots(index)
