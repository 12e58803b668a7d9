"""The eviction orders (kvtierd/index/eviction_order.py, s3fifo_order.py): random operations against a
model of which keys are evictable, and S3-FIFO against LRU on the traces it is built for."""

from __future__ import annotations

import copy
from collections.abc import Hashable
from typing import TypeVar

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvtierd.index.eviction_order import EVICTION_ORDERS, EvictionOrder, LruOrder, make_eviction_order
from kvtierd.index.s3fifo_order import S3FifoOrder

KEYS = st.integers(0, 15)
K = TypeVar("K", bound=Hashable)


def access(order: EvictionOrder[int], key: int, capacity: int) -> bool:
    """A cache of `capacity` keys reading `key`: a hit takes it out and gives it back (as a tier does
    around a load); a miss evicts the next victim when full. Returns whether it hit."""
    if key in order:
        order.remove(key)
        order.insert(key)
        return True
    if len(order) >= capacity:
        order.pop()
    order.insert(key)
    return False


def pop_all(order: EvictionOrder[K]) -> list[K]:
    return [order.pop() for _ in range(len(order))]


class OrderMachine(RuleBasedStateMachine):
    """Keys are evictable (in the order), taken out for a use, or gone; no operation loses or
    duplicates one, and iteration names the keys in the order pop takes them."""

    name = "lru"

    def __init__(self) -> None:
        super().__init__()
        self.order: EvictionOrder[int] = make_eviction_order(self.name)
        self.evictable: set[int] = set()
        self.taken: set[int] = set()

    @rule(key=KEYS, first=st.booleans())
    def insert(self, key, first):
        if key in self.evictable:
            return
        if first:
            self.order.insert_first(key)
            assert next(iter(self.order)) == key, "insert_first makes the next victim"
        else:
            self.order.insert(key)
        self.evictable.add(key)
        self.taken.discard(key)

    @rule(key=KEYS)
    def remove(self, key):
        if key not in self.evictable:
            with pytest.raises(KeyError):
                self.order.remove(key)
            return
        self.order.remove(key)
        self.evictable.remove(key)
        self.taken.add(key)

    @rule(key=KEYS)
    def discard(self, key):
        self.order.discard(key)
        self.evictable.discard(key)
        self.taken.discard(key)

    @precondition(lambda self: self.evictable)
    @rule()
    def pop(self):
        expected = next(iter(self.order))
        assert self.order.pop() == expected
        self.evictable.remove(expected)

    @invariant()
    def holds_each_evictable_key_once(self):
        keys = list(self.order)
        assert len(keys) == len(set(keys)) == len(self.order)
        assert set(keys) == self.evictable
        assert all((key in self.order) == (key in self.evictable) for key in range(16))

    @invariant()
    def iterates_in_pop_order(self):
        assert pop_all(copy.deepcopy(self.order)) == list(self.order)


class S3FifoMachine(OrderMachine):
    name = "s3fifo"


TestLruOrder = OrderMachine.TestCase
TestS3FifoOrder = S3FifoMachine.TestCase
TestLruOrder.settings = TestS3FifoOrder.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)


def read_twice_then_scan(order: EvictionOrder[int], capacity: int = 10, num_scanned: int = 30) -> bool:
    """Key 0 is read, then hit twice among other keys; a scan of one-off keys follows. Is 0 still cached?"""
    trace = [0, 1, 2, 0, 3, 0] + list(range(100, 100 + num_scanned))
    for key in trace:
        access(order, key, capacity)
    return 0 in order


def test_s3fifo_keeps_a_key_hit_twice_through_a_scan_that_lru_evicts():
    """The scan passes through S3-FIFO's small queue; LRU lets it push out the hot key."""
    assert read_twice_then_scan(S3FifoOrder()) is True
    assert read_twice_then_scan(LruOrder()) is False


def test_s3fifo_hits_more_than_lru_on_a_hot_set_under_a_scan():
    """Three hot keys read again and again between one-off keys: LRU loses them to each burst."""
    trace = [key for burst in range(20) for key in [0, 1, 2, *range(1000 * (burst + 1), 1000 * (burst + 1) + 12)]]
    hits = {name: sum(access(order, key, 10) for key in trace)
            for name, order in (("lru", LruOrder()), ("s3fifo", S3FifoOrder()))}
    # S3-FIFO: new in burst 0 (evicted from small, into the ghost), back from the ghost into main in
    # burst 1, hits in each of the 18 bursts after
    assert hits == {"lru": 0, "s3fifo": 54}


def test_a_key_back_from_the_ghost_goes_to_main():
    """A one-off evicted from small and read again soon after is kept through the next scan."""
    order: S3FifoOrder[int] = S3FifoOrder()
    for key in range(10):
        access(order, key, 10)
    access(order, 10, 10)  # evicts 0 from small into the ghost
    assert 0 not in order
    access(order, 0, 10)  # back from the ghost: into main
    for key in range(200, 230):
        access(order, key, 10)
    assert 0 in order


def test_main_rounds_a_key_once_per_hit_then_evicts_it():
    """Main's head with frequency f goes round f more times; the count is capped at 3."""
    order: S3FifoOrder[str] = S3FifoOrder()
    order.insert("hot")
    for _ in range(5):  # five hits: frequency 3 (the cap)
        order.remove("hot")
        order.insert("hot")
    order.insert("cold")
    order.remove("cold")
    order.insert("cold")  # one hit: frequency 1
    # main holds hot (3) and cold (1); small is empty, so main gives every victim
    assert list(order) == ["cold", "hot"]
    assert pop_all(order) == ["cold", "hot"]


def test_discard_forgets_a_taken_key():
    """A key taken out and then discarded (it left the cache) comes back as new, not as a hit."""
    order: S3FifoOrder[int] = S3FifoOrder()
    for key in range(5):
        order.insert(key)
    order.remove(0)
    order.discard(0)
    order.insert(0)
    assert list(order) == [1, 2, 3, 4, 0]  # all in small, 0 last in: no hit counted


def test_the_ghost_remembers_ghost_keys_not_keys():
    """T0's keys are blocks, reused for other content: the ghost names what a key held."""
    content = {"block-a": b"x", "block-b": b"x", "filler": b"f", "one-off": b"o"}
    order: S3FifoOrder[str] = S3FifoOrder(content.__getitem__)
    order.insert("block-a")
    order.insert("filler")
    assert order.pop() == "block-a"  # small's head, its content into the ghost
    order.insert("block-b")  # another block holding the same content: from the ghost, to main
    order.insert("one-off")
    assert pop_all(order) == ["filler", "one-off", "block-b"]


@pytest.mark.parametrize("name", EVICTION_ORDERS)
def test_pop_of_an_empty_order_raises(name):
    with pytest.raises(KeyError):
        make_eviction_order(name).pop()


def test_an_unknown_order_is_refused_with_the_valid_names():
    with pytest.raises(ValueError, match="'lfu': one of lru, s3fifo"):
        make_eviction_order("lfu")
