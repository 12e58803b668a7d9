"""T0 blocks whose evicted bytes are still being copied down: nobody writes them until landed.

The block index hands an evicted block to its next holder at once (under its lock, which is
never held across a copy). The eviction hook only plans the copy down and registers the block
here; a mover thread copies it and ends the write-back. Until then every writer of that block
waits: the daemon answers Acquire / AppendBlocks (whose caller writes the blocks) only once
`when_landed` resolves, a promotion loads into its targets after it, and Put writes after it.
Lookups never see a half-written lower-tier entry: the T1 slots are STORING meanwhile.
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
from collections.abc import Iterable


class WriteBacks:
    """block id → number of write-backs in flight from it; waiters for sets of block ids.

    Invariant: a waiter's future resolves only once none of its blocks has a write-back in
    flight; every future `when_landed` returns is the caller's own (cancelling it harms nobody).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._num_in_flight: collections.Counter[int] = collections.Counter()  # under _lock
        self._waiters: list[tuple[frozenset[int], concurrent.futures.Future[None]]] = []  # under _lock

    def begin(self, block_ids: Iterable[int]) -> tuple[int, ...]:
        """The blocks' old bytes are being copied down from now on; pass the result to `end`."""
        block_ids = tuple(block_ids)
        with self._lock:
            self._num_in_flight.update(block_ids)
        return block_ids

    def end(self, block_ids: tuple[int, ...]) -> None:
        """The copy of `begin(block_ids)` landed (or failed): the blocks may be written."""
        with self._lock:
            self._num_in_flight.subtract(block_ids)
            for block_id in block_ids:
                assert self._num_in_flight[block_id] >= 0, block_id
                if self._num_in_flight[block_id] == 0:
                    del self._num_in_flight[block_id]
            ready = [f for blocks, f in self._waiters if not any(b in self._num_in_flight for b in blocks)]
            self._waiters = [(blocks, f) for blocks, f in self._waiters if f not in ready]
        for future in ready:
            if future.set_running_or_notify_cancel():
                future.set_result(None)

    def when_landed(self, block_ids: Iterable[int]) -> concurrent.futures.Future[None] | None:
        """A future that resolves once none of the blocks has a write-back in flight; None when
        none has one now (the common case: no wait at all)."""
        with self._lock:
            if not self._num_in_flight:  # the common case, without a pass over the blocks
                return None
            blocks = frozenset(b for b in block_ids if b in self._num_in_flight)
            if not blocks:
                return None
            future: concurrent.futures.Future[None] = concurrent.futures.Future()
            self._waiters.append((blocks, future))
            return future

    @property
    def num_waiting(self) -> int:
        """Waiters not yet resolved (for tests and stats)."""
        with self._lock:
            return len(self._waiters)

    @property
    def num_in_flight(self) -> int:
        """Blocks with a write-back in flight (for tests and stats)."""
        with self._lock:
            return len(self._num_in_flight)
