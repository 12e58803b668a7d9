"""LookupHolds: a Lookup's promise held in T0 (a reference) and T1 (pins) until released, replaced
or lapsed, within a quarter of each tier."""

from __future__ import annotations

from kvtierd.tier import TierCounts
from tests.factories import NAMESPACE, FakeClock, tokens
from tests.tiering.test_tier_manager import PROMPT, push_out
from tests.tiering.tier_factories import make_manager, prefill

KEY = (b"tenant", "req-1")


def test_a_t0_hold_keeps_its_blocks_out_of_the_free_queue_until_it_lapses():
    manager = make_manager(num_device_blocks=16)
    clock = FakeClock()
    manager.lookup_holds.clock = clock
    try:
        prefill(manager, "a", PROMPT)
        manager.release("a")
        chain = NAMESPACE.hash_blocks(PROMPT)
        free_before = manager.index.free_queue.num_free_blocks
        assert manager.hold_promise(KEY, chain, PROMPT, TierCounts(t0=4), TierCounts()) == TierCounts(t0=4)
        assert manager.index.free_queue.num_free_blocks == free_before - 4
        clock.advance(4.9)
        assert manager.lookup_holds.expire() == 0
        clock.advance(0.2)
        assert manager.lookup_holds.expire() == 1 and manager.lookup_holds.num_expired_holds == 1
        assert manager.index.free_queue.num_free_blocks == free_before
        assert manager.lookup_holds.num_t0_blocks == 0 and not manager.release_promise(KEY)
    finally:
        manager.close()


def test_a_hold_takes_at_most_a_quarter_of_t0_and_declined_hits_are_not_held():
    manager = make_manager(num_device_blocks=8)
    try:
        prefill(manager, "a", PROMPT)
        manager.release("a")
        chain = NAMESPACE.hash_blocks(PROMPT)
        assert manager.hold_promise(KEY, chain, PROMPT, TierCounts(t0=4), TierCounts()) == TierCounts(t0=2)
        assert manager.release_promise(KEY)
        other = (b"tenant", "req-2")
        assert manager.hold_promise(other, chain, PROMPT, TierCounts(t0=4), TierCounts(t0=3)) == TierCounts(t0=1)
        manager.lookup_holds.release_all()
        assert manager.lookup_holds.num_t0_blocks == 0 and manager.index.free_queue.num_free_blocks == 8
    finally:
        manager.close()


def test_a_t1_hold_pins_the_promised_entries_and_replacing_it_unpins_them():
    manager = make_manager(num_device_blocks=8, host_blocks=32)
    try:
        prefill(manager, "a", PROMPT)
        manager.release("a")
        push_out(manager)  # PROMPT's blocks only in T1
        chain = NAMESPACE.hash_blocks(PROMPT)
        host = manager.tiers.host
        assert host is not None
        assert manager.hold_promise(KEY, chain, PROMPT, TierCounts(t1=4), TierCounts()) == TierCounts(t1=4)

        def loads() -> list[int]:
            held = {e.block_hash: e.num_loads for e in host.index.entries()}
            return [held.get(h, -1) for h in chain]

        assert loads() == [1, 1, 1, 1]
        other = tokens(50_000, len(PROMPT))
        assert manager.hold_promise(KEY, NAMESPACE.hash_blocks(other), other, TierCounts(), TierCounts()) \
            == TierCounts()  # the same key: the first hold given back
        assert loads() == [0, 0, 0, 0]
        assert manager.lookup_holds.num_t1_blocks == 0 and not manager.lookup_holds.holds
    finally:
        manager.close()
