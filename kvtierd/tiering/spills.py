"""T1's victims on their way to T2 (T1 → T2 `on_evict`): rows copied out of their slots before
the slots are reused, then written to T2 by one spill thread, off the event loop and off every
index lock, so a slow disk delays nobody but the evictions that feed it.

The backlog is bounded (batches and bytes): `queue` blocks its caller — a mover or copy
thread, never the loop — while it is full. That is the backpressure of a slow disk: the client
whose Acquire evicts waits (its blocks become writable later), every other client goes on.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from kvtierd.index.slot_entry import SlotEntry

MAX_PENDING_BATCHES = 2
MAX_PENDING_BYTES = 256 << 20


class Spills:
    """Invariant: at most `max_pending_batches` batches and `max_pending_bytes` bytes are queued
    or being written, except a single batch larger than the byte bound, which goes alone."""

    def __init__(self, dispatch: Callable[[Callable[[], None]], None], max_pending_batches: int = MAX_PENDING_BATCHES,
                 max_pending_bytes: int = MAX_PENDING_BYTES) -> None:
        self._dispatch = dispatch  # runs work on the spill thread
        self.max_pending_batches, self.max_pending_bytes = max_pending_batches, max_pending_bytes
        self._room = threading.Condition()
        self.num_pending_batches = self.num_pending_bytes = 0  # under _room

    def queue(self, entries: list[SlotEntry], rows: torch.Tensor,
              store: Callable[[list[SlotEntry], torch.Tensor], int]) -> None:
        """`store(entries, rows)` (T1 entries, a copy of their rows in T2's codec) in the background;
        blocks while the backlog is full."""
        nbytes = rows.numel()
        with self._room:
            self._room.wait_for(lambda: self.num_pending_batches == 0 or (
                self.num_pending_batches < self.max_pending_batches
                and self.num_pending_bytes + nbytes <= self.max_pending_bytes))
            self.num_pending_batches += 1
            self.num_pending_bytes += nbytes

        def write() -> None:
            try:
                store(entries, rows)
            finally:
                with self._room:
                    self.num_pending_batches -= 1
                    self.num_pending_bytes -= nbytes
                    self._room.notify_all()

        self._dispatch(write)
