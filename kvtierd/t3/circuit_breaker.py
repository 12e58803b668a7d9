"""A circuit breaker per store node: a node that is down answers at once, it does not look slow.

    closed ──(`max_failures` calls in a row failed)──▶ open ──(`open_s` passed)──▶ half_open
      ▲                                                  ▲                          │
      └──────────────(the one probe call succeeded)──────┼──────────────────────────┤
                                                         └────(the probe failed)────┘

While open, `allow()` is False: callers treat the node's keys as misses and drop its writes, and
no request waits on it. Half-open lets exactly one call through (the probe); the others still
see False until it reports. A call fails within the store's socket timeout, so the breaker opens
at most `max_failures × timeout_s` after a node stops answering (SGLang asks for this; LMCache
once hung on a dead server). Thread-safe.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable


class BreakerState(str, enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class CircuitBreaker:
    def __init__(self, max_failures: int = 3, open_s: float = 5.0, clock: Callable[[], float] = time.monotonic) -> None:
        assert max_failures >= 1 and open_s > 0
        self.max_failures = max_failures
        self.open_s = open_s
        self._clock = clock
        self._lock = threading.Lock()
        self._state = BreakerState.CLOSED
        self._num_failures = 0  # consecutive, while closed
        self._opened_at_s = 0.0
        self._probing = False  # half-open: the probe call is out
        self.num_opened = 0  # times it opened, since start

    @property
    def state(self) -> BreakerState:
        with self._lock:
            return self._current()

    def allow(self) -> bool:
        """May a call go to the node now? In half-open, True for the one probe only."""
        with self._lock:
            state = self._current()
            if state is BreakerState.CLOSED:
                return True
            if state is BreakerState.HALF_OPEN and not self._probing:
                self._probing = True
                return True
            return False

    def succeeded(self) -> None:
        with self._lock:
            self._state = BreakerState.CLOSED
            self._num_failures = 0
            self._probing = False

    def failed(self) -> None:
        with self._lock:
            state = self._current()
            self._probing = False
            if state is BreakerState.CLOSED:
                self._num_failures += 1
                if self._num_failures < self.max_failures:
                    return
            if state is not BreakerState.OPEN:
                self.num_opened += 1
            self._state = BreakerState.OPEN
            self._opened_at_s = self._clock()
            self._num_failures = 0

    def _current(self) -> BreakerState:
        if self._state is BreakerState.OPEN and self._clock() - self._opened_at_s >= self.open_s:
            self._state = BreakerState.HALF_OPEN
        return self._state
