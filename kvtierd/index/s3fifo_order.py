"""S3-FIFO (Yang et al., "FIFO queues are all you need for cache eviction", SOSP'23) as an eviction
order (eviction_order.py states the surface): a scan of one-off keys passes through a small FIFO
and leaves, while keys that were used stay in a main FIFO.

Adapted to a cache where a hit takes the key out of the evictable set and gives it back later
(`remove`, then `insert`): the order remembers the frequency of a key taken out until it returns or
is discarded, and counts its return as the hit. The paper moves a hit key from small to main when
small evicts it; here the key comes back after its use, and goes to main then.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Hashable, Iterator
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)

MAX_FREQUENCY = 3  # a key's hits counted, at most: the times main lets it round again
SMALL_SHARE_DIVISOR = 10  # small takes the victim while it holds at least 1/10 of the keys
_ABSENT = object()


class S3FifoOrder(Generic[K]):
    """Four FIFOs: `stale` (keys made next victims by `insert_first`), `small` (probationary),
    `main` (keys with a frequency), `ghost` (recent victims of small, by `ghost_key`).

    Invariants:
    - a key is in at most one of stale, small, main; `len` counts those three, `in` tests them;
    - small's keys have no hit: a key coming back from a use (it is in `taken`) goes to main with its
      frequency + 1 (at most MAX_FREQUENCY); a new key goes to small, or to main with frequency 0
      when its ghost key is in the ghost (it was evicted from small lately);
    - `taken` holds only keys that are in none of the queues (taken out for a use, not discarded);
    - the next victim: the head of stale; else small's head while small holds at least
      1/SMALL_SHARE_DIVISOR of the keys (or main is empty), and it enters the ghost; else main's
      head, which rounds to main's tail with its frequency - 1 while that is above 0;
    - the ghost holds at most main's share of the keys (9/10 of small + main, at least 1), oldest
      dropped first: the paper sizes it as main.
    """

    def __init__(self, ghost_key: Callable[[K], Hashable] | None = None) -> None:
        self._stale: collections.OrderedDict[K, None] = collections.OrderedDict()
        self._small: collections.OrderedDict[K, None] = collections.OrderedDict()
        self._main: collections.OrderedDict[K, int] = collections.OrderedDict()  # key -> frequency
        self._taken: dict[K, int] = {}  # keys out for a use -> their frequency
        self._ghost: collections.OrderedDict[Hashable, None] = collections.OrderedDict()
        self._ghost_key: Callable[[K], Hashable] = ghost_key if ghost_key is not None else _identity

    def __len__(self) -> int:
        return len(self._stale) + len(self._small) + len(self._main)

    def __contains__(self, key: object) -> bool:
        return key in self._small or key in self._main or key in self._stale

    def insert(self, key: K) -> None:
        assert key not in self, "a key is inserted once"
        frequency = self._taken.pop(key, None)
        if frequency is not None:  # back from a use: a hit
            self._main[key] = min(frequency + 1, MAX_FREQUENCY)
        elif self._ghost.pop(self._ghost_key(key), _ABSENT) is not _ABSENT:  # evicted from small lately
            self._main[key] = 0
        else:
            self._small[key] = None

    def insert_first(self, key: K) -> None:
        assert key not in self, "a key is inserted once"
        self._taken.pop(key, None)
        self._stale[key] = None
        self._stale.move_to_end(key, last=False)

    def remove(self, key: K) -> None:
        if key in self._small:
            del self._small[key]
            self._taken[key] = 0
        elif key in self._main:
            self._taken[key] = self._main.pop(key)
        else:
            del self._stale[key]
            self._taken[key] = 0

    def discard(self, key: K) -> None:
        self._taken.pop(key, None)
        if self._small.pop(key, _ABSENT) is _ABSENT and self._main.pop(key, None) is None:
            self._stale.pop(key, None)

    def pop(self) -> K:
        if self._stale:
            return self._stale.popitem(last=False)[0]
        while True:
            if not self._small and not self._main:
                raise KeyError("pop(): the order is empty")
            if _small_evicts(len(self._small), len(self._main)):
                key = self._small.popitem(last=False)[0]
                self._remember(key)
                return key
            key, frequency = self._main.popitem(last=False)
            if not frequency:
                return key
            self._main[key] = frequency - 1

    def __iter__(self) -> Iterator[K]:
        """Next victim first: pop's choices played on copies (main's rounds included)."""
        yield from list(self._stale)
        small = list(self._small)
        main = collections.deque(self._main.items())
        num_small_taken = 0
        while num_small_taken < len(small) or main:
            if _small_evicts(len(small) - num_small_taken, len(main)):
                yield small[num_small_taken]
                num_small_taken += 1
                continue
            key, frequency = main.popleft()
            if frequency:
                main.append((key, frequency - 1))
            else:
                yield key

    def _remember(self, key: K) -> None:
        """Small evicted `key`: into the ghost, the oldest ghosts out past main's share."""
        ghost = self._ghost
        ghost_key = self._ghost_key(key)
        ghost[ghost_key] = None
        ghost.move_to_end(ghost_key)
        capacity = max(1, (len(self._small) + len(self._main)) * (SMALL_SHARE_DIVISOR - 1) // SMALL_SHARE_DIVISOR)
        while len(ghost) > capacity:
            ghost.popitem(last=False)


def _small_evicts(num_small: int, num_main: int) -> bool:
    """Does small give the next victim (S3-FIFO: while it holds at least its share, or main is empty)?"""
    return num_small > 0 and (num_main == 0 or num_small * SMALL_SHARE_DIVISOR >= num_small + num_main)


def _identity(key: Hashable) -> Hashable:
    return key
