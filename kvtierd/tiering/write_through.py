"""The T0 → T1 write-through backlog: committed blocks held in T0 until their copy down landed,
bounded in bytes by T0 itself and in time by `policy.write_through_wait_s`.

A commit under T0 → T1 write-through holds its blocks in T0 (neither evicted nor reused) and hands
them to the layout's write-through thread (offload.py), which reserves T1 slots for them. T1 may
have none to give: every slot STORING, or pinned by a copy further down (T1 → T2 write-through
pins what it stores until the disk has it). The thread then waits for T1 to change
(SlotIndex.wait_for_room), at most `write_through_wait_s` after the commit; the blocks still
without a slot are dropped from the edge and counted, never lost in silence. Meanwhile the
backlog's blocks are T0's: a Put that finds T0 full of them waits for them to go down
(`with_t0_room`), as long, rather than failing at once, so a burst larger than T1 slows the Put
instead of losing blocks. The event loop never waits here; the block index lock is never held.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TypeVar

from kvtierd.errors import ResourceExhausted

T = TypeVar("T")


class HeldBatch:
    """One commit's T0 blocks held for their way down, in parts (the wait for T1 slots, and each
    copy started): `release` runs once, when the last part ended.

    Invariant: `num_parts` > 0 until released; `add_part` only while a part is open."""

    def __init__(self, release: Callable[[], None]) -> None:
        self._release = release
        self._lock = threading.Lock()
        self.num_parts = 1  # the wait for slots, open from the start

    def add_part(self) -> None:
        with self._lock:
            assert self.num_parts > 0, "a part added to a released batch"
            self.num_parts += 1

    def end_part(self) -> None:
        with self._lock:
            assert self.num_parts > 0, "a part of a released batch ended"
            self.num_parts -= 1
            last = self.num_parts == 0
        if last:
            self._release()


class WriteThroughBacklog:
    """The T0 blocks held by write-through copies not yet landed, and the waiters for them to go.

    Invariant: `num_held_blocks` is the sum over open batches of their blocks; a waiter of
    `with_t0_room` wakes on every release (`_num_releases` changes under `_released`)."""

    def __init__(self, wait_s: float) -> None:
        self.wait_s = wait_s  # policy.write_through_wait_s
        self._released = threading.Condition()
        self.num_held_blocks = 0  # under _released
        self.num_waiting = 0  # callers of with_t0_room waiting now (for tests and stats); under _released
        self._num_releases = 0  # under _released

    def hold(self, num_blocks: int, release: Callable[[], None]) -> HeldBatch:
        """A batch of `num_blocks` T0 blocks, just held; `release` frees them (the T0 hold)."""
        with self._released:
            self.num_held_blocks += num_blocks

        def released() -> None:
            release()
            with self._released:
                self.num_held_blocks -= num_blocks
                self._num_releases += 1
                self._released.notify_all()

        return HeldBatch(released)

    def deadline(self) -> float:
        """The monotonic time until which a batch committed now may wait for room below."""
        return time.monotonic() + self.wait_s

    def with_t0_room(self, take: Callable[[], T]) -> T:
        """`take()` (an allocation of T0 blocks); when it raises ResourceExhausted while this
        backlog holds T0 blocks, wait for one of its batches to go and try again, at most
        `wait_s` in all; then the last ResourceExhausted. Blocking: never on the event loop."""
        deadline = self.deadline()
        while True:
            with self._released:
                num_releases = self._num_releases
            try:
                return take()
            except ResourceExhausted:
                with self._released:  # nothing held: nothing to wait for
                    self.num_waiting += 1
                    try:
                        self._released.wait_for(lambda: self._num_releases != num_releases or not self.num_held_blocks,
                                                max(0.0, deadline - time.monotonic()))
                    finally:
                        self.num_waiting -= 1
                    if self._num_releases == num_releases:
                        raise
