"""Work that arrives in pieces and runs one batch at a time: the pieces that arrive while a batch
runs make up the next one.

The offload edges get blocks commit by commit, a few at a time, and a run down an edge costs much
the same whatever its size: a copy job's hand-offs between threads, a disk write's sync and its two
index transactions. One batch at a time, a piece that finds the edge idle starts at once, and the
pieces that come while it runs share the next run's fixed cost: the busier the edge, the larger its
batches (bench_store_cpu measures the daemon's CPU per stored block).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

log = logging.getLogger(__name__)

P = TypeVar("P")


class SerialBatches(Generic[P]):
    """Pieces queued, run as batches, one batch at a time.

    `run(batch, done)` starts a batch (it may return before the batch ended) and calls `done()`
    once it ended, from any thread; `done` starts the next batch. A batch takes the queued pieces in
    their order up to `max_size` (by `size(piece)`; one piece always, whatever its size).

    Invariant: at most one batch is running (`_running`), and while pieces are queued one is; each
    batch's `done` acts once (a second call is an error)."""

    def __init__(self, run: Callable[[list[P], Callable[[], None]], None], size: Callable[[P], int],
                 max_size: int) -> None:
        assert max_size > 0, max_size
        self._run = run
        self._size = size
        self.max_size = max_size
        self._lock = threading.Lock()
        self._queued: list[P] = []  # under _lock
        self._running = False  # under _lock
        self.num_batches = 0  # batches started (for stats and tests); under _lock

    def add(self, piece: P) -> None:
        """Queue `piece`; start a batch when none runs. Never waits for a batch."""
        with self._lock:
            self._queued.append(piece)
            if self._running:
                return
            self._running = True
        self._start_next()

    def _start_next(self) -> None:
        """Run the queued pieces as batches until one is left running (it ends later, on another
        thread) or none is queued (the batches stop). A batch that ended inside `run` loops here
        rather than recursing."""
        while True:
            with self._lock:
                if not self._queued:
                    self._running = False
                    return
                taken, total = 0, 0
                for piece in self._queued:
                    total += self._size(piece)
                    if taken and total > self.max_size:
                        break
                    taken += 1
                batch, self._queued = self._queued[:taken], self._queued[taken:]
                self.num_batches += 1
            if not self._started(batch):
                return

    def _started(self, batch: list[P]) -> bool:
        """Run `batch`; True when it ended before `run` returned (the caller starts the next one)."""
        state_lock = threading.Lock()
        state = {"starting": True, "ended": False}

        def done() -> None:
            with state_lock:
                assert not state["ended"], "a batch ended twice"
                state["ended"] = True
                if state["starting"]:
                    return  # run has not returned: _start_next goes on
            self._start_next()

        try:
            self._run(batch, done)
        except Exception:  # `run` reports its own failures; one that raises still ends its batch
            log.exception("a batch of %d pieces failed to start", len(batch))
            with state_lock:
                state["ended"] = True
        with state_lock:
            state["starting"] = False
            return state["ended"]
