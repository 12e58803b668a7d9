"""Writes to the shared store, bounded: a queue drained by one writer thread.

`offer` never waits: the movers and the spill thread hand over framed blocks and go on. Frames
queued or in flight hold at most `max_backlog_bytes`; a frame beyond that is dropped and counted
(the store is a cache: a block not written is a later miss, never wrong bytes), so a slow or
dead store costs memory up to the bound and nothing else. The writer batches what is queued,
up to `batch_bytes`, into one call (one pipeline per store node).
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable, Sequence, Sized
from typing import Generic, TypeVar

log = logging.getLogger(__name__)
FrameT = TypeVar("FrameT", bound=Sized)  # what is written under a key: its len() is its bytes


class RemoteWrites(Generic[FrameT]):
    def __init__(self, write: Callable[[list[tuple[bytes, FrameT]]], list[bool]], max_backlog_bytes: int,
                 on_written: Callable[[list[tuple[bytes, FrameT]], list[bool]], None],
                 batch_bytes: int = 64 << 20, on_dropped: Callable[[list[bytes]], None] = lambda keys: None) -> None:
        """`on_dropped(keys)`: told (on the offering thread) which keys `offer` dropped."""
        self.max_backlog_bytes = max_backlog_bytes
        self._on_dropped = on_dropped
        self.batch_bytes = batch_bytes
        self._write = write
        self._on_written = on_written
        self._queue: collections.deque[tuple[bytes, FrameT]] = collections.deque()
        self._cond = threading.Condition()
        self.backlog_bytes = 0  # queued + in flight; guarded by _cond
        self._num_in_flight = 0
        self.num_dropped = 0
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kvtierd-t3-writer", daemon=True)
        self._thread.start()

    def offer(self, items: Sequence[tuple[bytes, FrameT]]) -> int:
        """Queue (key, frame) pairs (a frame: anything with a len(), in bytes); returns how many were
        queued (the rest were dropped)."""
        num_queued = 0
        dropped = []
        with self._cond:
            for key, frame in items:
                if self._closed or self.backlog_bytes + len(frame) > self.max_backlog_bytes:
                    self.num_dropped += 1
                    dropped.append(key)
                    continue
                self._queue.append((key, frame))
                self.backlog_bytes += len(frame)
                num_queued += 1
            if num_queued:
                self._cond.notify_all()
        if dropped:
            self._on_dropped(dropped)
        return num_queued

    def discard(self, drop: Callable[[bytes], bool]) -> int:
        """Remove the queued writes whose key `drop` names (not the batch in flight); how many."""
        with self._cond:
            kept = [(key, frame) for key, frame in self._queue if not drop(key)]
            num_dropped = len(self._queue) - len(kept)
            self.backlog_bytes -= sum(len(frame) for key, frame in self._queue if drop(key))
            self._queue = collections.deque(kept)
            self._cond.notify_all()
        return num_dropped

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Until nothing is queued or in flight; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and not self._num_in_flight, timeout_s)

    def close(self) -> None:
        """Write what is queued, then stop the writer."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closed)
                if not self._queue:
                    return
                batch, nbytes = [], 0
                while self._queue and (not batch or nbytes + len(self._queue[0][1]) <= self.batch_bytes):
                    batch.append(self._queue.popleft())
                    nbytes += len(batch[-1][1])
                self._num_in_flight += len(batch)
            try:
                written = self._write(batch)
            except Exception:  # the store reports its own failures as False; anything else is a bug
                log.exception("writing %d blocks to the T3 store failed", len(batch))
                written = [False] * len(batch)
            try:
                self._on_written(batch, written)
            finally:
                with self._cond:
                    self._num_in_flight -= len(batch)
                    self.backlog_bytes -= nbytes
                    self._cond.notify_all()
