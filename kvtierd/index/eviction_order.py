"""The order in which a tier's evictable keys leave: the policy of class NONE (entries without a live
retention hint) in T0's free queue and T1/T2's slot indexes, named by `[policy] t0_eviction`,
`t1_eviction`, `t2_eviction`.

An order holds keys only (any hashable: a block hash, a KVBlock, a trace's ids), no locks, tiers or
blocks, so a trace simulator drives the same classes the daemon does. A key is in the order while it
is evictable; a use takes it out and gives it back, so to an order a hit is `remove(key)` followed
by `insert(key)`:

- `insert(key)`: the key (back) in the evictable set. A key taken out by `remove` and not discarded
  since is coming back from a use: a hit. Any other key is new.
- `insert_first(key)`: the key is the next victim (it outstayed a protection: a lapsed hint).
- `remove(key)`: the key leaves the evictable set for a use; the order may remember it until it is
  inserted again or discarded.
- `discard(key)`: the key left the cache: out of the order if there, and forgotten.
- `pop()`: the next victim leaves the cache (forgotten, as by discard).
- `len`, `in` (is the key evictable now?), iteration: the keys, next victim first (the order `pop`
  would take them in were nothing inserted meanwhile).

LruOrder is least recently inserted first; S3FifoOrder (s3fifo_order.py) is frequency-aware.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Hashable, Iterator
from typing import Generic, Protocol, TypeVar

from kvtierd.index.s3fifo_order import S3FifoOrder

K = TypeVar("K", bound=Hashable)

EVICTION_ORDERS = ("lru", "s3fifo")  # the names make_eviction_order takes, the default first


class EvictionOrder(Protocol[K]):
    """What a tier asks of an eviction order (the module's docstring says what each call means)."""

    def insert(self, key: K) -> None: ...
    def insert_first(self, key: K) -> None: ...
    def remove(self, key: K) -> None: ...
    def discard(self, key: K) -> None: ...
    def pop(self) -> K: ...
    def __len__(self) -> int: ...
    def __contains__(self, key: object) -> bool: ...
    def __iter__(self) -> Iterator[K]: ...


class LruOrder(Generic[K]):
    """Least recently inserted first: one OrderedDict of keys, head = next victim.

    Invariants: each key is held at most once; `insert` appends at the tail, `insert_first` puts the
    key at the head, `pop` takes the head. It keeps no history: `remove` and `discard` differ only in
    that `remove` wants the key present.
    """

    def __init__(self) -> None:
        self._keys: collections.OrderedDict[K, None] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __iter__(self) -> Iterator[K]:
        return iter(self._keys)

    def insert(self, key: K) -> None:
        assert key not in self._keys, "a key is inserted once"
        self._keys[key] = None

    def insert_first(self, key: K) -> None:
        self.insert(key)
        self._keys.move_to_end(key, last=False)

    def remove(self, key: K) -> None:
        del self._keys[key]

    def discard(self, key: K) -> None:
        self._keys.pop(key, None)

    def pop(self) -> K:
        if not self._keys:
            raise KeyError("pop(): the order is empty")
        return self._keys.popitem(last=False)[0]


def make_eviction_order(name: str, ghost_key: Callable[[K], Hashable] | None = None) -> EvictionOrder[K]:
    """The order called `name` (one of EVICTION_ORDERS). `ghost_key`: what S3-FIFO's ghost remembers
    of an evicted key (default the key itself; T0, whose keys are blocks, remembers their hash)."""
    if name == "lru":
        return LruOrder()
    if name == "s3fifo":
        return S3FifoOrder(ghost_key)
    raise ValueError(f"unknown eviction order {name!r}: one of {', '.join(EVICTION_ORDERS)}")
