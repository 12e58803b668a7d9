"""The copy engine: where bytes move between tiers. One per device (factory.CopyEngines), one interface.

A caller submits a *job* (a function that issues the copies of one batch of blocks) with its
direction and byte count, and gets a Transfer to wait on. Without CUDA the job runs on a small
thread pool and does real copies (torch releases the GIL while copying); with CUDA
(cuda_copy_engine.py) the job is enqueued on the direction's stream and completes when its
event fires. In-flight bytes are bounded: `submit` blocks while the budget is spent
(backpressure), so a burst of evictions can never queue unbounded memory.
"""

from __future__ import annotations

import abc
import collections
import concurrent.futures
import contextlib
import enum
import statistics
import threading
import time
from collections.abc import Callable, Iterator

from kvtierd.errors import InvalidArgument

Job = Callable[[], None]


class Direction(enum.Enum):
    DEVICE_TO_HOST = "d2h"
    HOST_TO_DEVICE = "h2d"
    HOST_TO_HOST = "h2h"


class Bandwidth:
    """Measured bytes per second of one direction (or one store's reads): the median rate of the
    last RECENT_SAMPLES copies, the first guess until the first. A median, not a moving average:
    one copy stalled by the scheduler on a loaded node (milliseconds for kilobytes) would drag an
    average down by orders of magnitude for many copies after it, and a load decision made on it
    (tiering/load_decision.py) would decline every hit of a healthy tier.

    Invariants: `num_samples` counts every sample recorded; `bytes_per_s` is the initial guess
    while it is 0, else the median of the last min(num_samples, RECENT_SAMPLES) sample rates."""

    RECENT_SAMPLES = 16

    def __init__(self, initial_bytes_per_s: float) -> None:
        assert initial_bytes_per_s > 0, initial_bytes_per_s
        self.bytes_per_s = initial_bytes_per_s
        self.num_samples = 0
        self.total_bytes = 0
        self._recent_rates: collections.deque[float] = collections.deque(maxlen=self.RECENT_SAMPLES)
        self._lock = threading.Lock()

    def record(self, nbytes: int, seconds: float) -> None:
        if nbytes <= 0 or seconds <= 0:
            return
        with self._lock:
            self._recent_rates.append(nbytes / seconds)
            self.bytes_per_s = statistics.median(self._recent_rates)
            self.num_samples += 1
            self.total_bytes += nbytes

    def seconds_for(self, nbytes: int) -> float:
        return nbytes / self.bytes_per_s

    @contextlib.contextmanager
    def measure(self, nbytes: int) -> Iterator[None]:
        """Record a sample for the code inside the block (not when it raises)."""
        start = time.perf_counter()
        yield
        self.record(nbytes, time.perf_counter() - start)


class Transfer:
    """One submitted batch; `wait` returns when its bytes have landed, or raises its error.
    `on_landed(transfer)` (the submitter's byte count) runs once it landed, before it resolves."""

    def __init__(self, direction: Direction, nbytes: int,
                 on_landed: Callable[[Transfer], None] | None = None) -> None:
        self.direction = direction
        self.nbytes = nbytes
        self.on_landed = on_landed
        self.future: concurrent.futures.Future[None] = concurrent.futures.Future()

    def land(self, bandwidth: Bandwidth, seconds: float) -> None:
        """The copy landed in `seconds`: a bandwidth sample, the submitter's count, then resolved
        (so whoever waits on it sees both)."""
        bandwidth.record(self.nbytes, seconds)
        try:
            if self.on_landed is not None:
                self.on_landed(self)
        finally:
            self.future.set_result(None)

    def wait(self, timeout_s: float | None = None) -> None:
        self.future.result(timeout_s)

    def done(self) -> bool:
        return self.future.done()

    def add_done_callback(self, callback: Callable[[Transfer], None]) -> None:
        self.future.add_done_callback(lambda _: callback(self))


class CopyEngine(abc.ABC):
    """Runs copy jobs in the background with bounded in-flight bytes; measures bandwidth.

    Invariants: the bytes of submitted, unfinished transfers never exceed `max_inflight_bytes`,
    except for a single transfer larger than the budget, which runs alone (no other transfer, not
    even one of 0 bytes, is in flight beside it). A held-back submit waits only while it does not
    fit. Held-back submits are not served in order: when a transfer finishes, every waiting submit
    that now fits goes, so a small one may pass a larger one, and one larger than the budget waits
    until nothing is in flight. Each transfer completes once (its result or its job's error) and
    its bytes are given back when it does, before its done callbacks added after submit run.
    """

    def __init__(self, max_inflight_bytes: int, initial_bytes_per_s: dict[Direction, float]) -> None:
        if max_inflight_bytes <= 0:
            raise InvalidArgument(f"max_inflight_bytes must be positive, got {max_inflight_bytes}")
        self.max_inflight_bytes = max_inflight_bytes
        self.bandwidth = {d: Bandwidth(initial_bytes_per_s[d]) for d in Direction}
        self.inflight_bytes = 0
        self.num_inflight_transfers = 0  # submitted, unfinished (under _budget): "alone" means none
        self.num_waiting_submits = 0  # callers of submit held back by the budget (under _budget)
        self._budget = threading.Condition()
        self.closed = False

    def submit(self, direction: Direction, job: Job, nbytes: int,
               on_landed: Callable[[Transfer], None] | None = None) -> Transfer:
        """Start a job; blocks while the in-flight budget is spent. `on_landed`: see Transfer."""
        if self.closed:
            raise RuntimeError("copy engine is closed")
        with self._budget:
            self.num_waiting_submits += 1
            self._budget.wait_for(lambda: self.num_inflight_transfers == 0
                                  or self.inflight_bytes + nbytes <= self.max_inflight_bytes)
            self.num_waiting_submits -= 1
            self.inflight_bytes += nbytes
            self.num_inflight_transfers += 1
        transfer = Transfer(direction, nbytes, on_landed)
        transfer.add_done_callback(self._release)
        try:
            self._start(transfer, job)
        except BaseException as e:
            if not transfer.done():
                transfer.future.set_exception(e)
        return transfer

    def run(self, direction: Direction, job: Job, nbytes: int) -> None:
        """Submit and wait: for copies that must land before the caller goes on."""
        self.submit(direction, job, nbytes).wait()

    def _release(self, transfer: Transfer) -> None:
        with self._budget:
            self.inflight_bytes -= transfer.nbytes
            self.num_inflight_transfers -= 1
            self._budget.notify_all()

    @abc.abstractmethod
    def _start(self, transfer: Transfer, job: Job) -> None:
        """Begin the job; `transfer.land(...)` when it has landed (or set its exception)."""

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Wait until nothing is in flight; False on timeout."""
        with self._budget:
            return self._budget.wait_for(lambda: self.num_inflight_transfers == 0, timeout_s)

    def close(self) -> None:
        """Finish what is in flight, then refuse new work."""
        self.closed = True
        self.wait_idle()


class ThreadCopyEngine(CopyEngine):
    """Without CUDA: jobs run on `num_threads` threads doing real copies."""

    def __init__(self, num_threads: int = 2, max_inflight_bytes: int = 256 << 20) -> None:
        host_bytes_per_s = 5e9  # a first guess until measured: memcpy-class
        super().__init__(max_inflight_bytes, {d: host_bytes_per_s for d in Direction})
        self._pool = concurrent.futures.ThreadPoolExecutor(num_threads, thread_name_prefix="kvtierd-copy")

    def _start(self, transfer: Transfer, job: Job) -> None:
        run_on_pool(self._pool, transfer, job, self.bandwidth[transfer.direction])

    def close(self) -> None:
        super().close()
        self._pool.shutdown(wait=True)


def run_on_pool(pool: concurrent.futures.Executor, transfer: Transfer, job: Job, bandwidth: Bandwidth) -> None:
    """Run a job on a thread; resolve its transfer and record its bandwidth when it returns."""
    def run() -> None:
        start = time.perf_counter()
        try:
            job()
        except BaseException as e:
            transfer.future.set_exception(e)
            return
        transfer.land(bandwidth, time.perf_counter() - start)

    pool.submit(run)
