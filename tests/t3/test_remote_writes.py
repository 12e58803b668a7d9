"""T3's bounded writer: offer never waits, frames beyond max_backlog_bytes (queued + in flight) are
dropped and counted, never held; what was queued is written (close included) and the backlog returns
to 0; a write that raises costs its frames, not the writer."""

from __future__ import annotations

import threading

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvtierd.t3.remote_writes import RemoteWrites
from tests.t3.redis_cluster import wait_until

FRAME = 100  # bytes of each test frame


def items(first: int, count: int, size: int = FRAME) -> list[tuple[bytes, bytes]]:
    return [(b"k%d" % i, bytes([i % 256]) * size) for i in range(first, first + count)]


class GatedStore:
    """A write function that records each batch and blocks until `gate` is set."""

    def __init__(self, gated: bool = True) -> None:
        self.gate = threading.Event()
        if not gated:
            self.gate.set()
        self.lock = threading.Lock()
        self.calls: list[list[tuple[bytes, bytes]]] = []  # every batch handed to write, in order
        self.written: list[tuple[bytes, bytes]] = []  # what on_written reported as written
        self.reported: list[tuple[list, list[bool]]] = []

    def write(self, batch):
        with self.lock:
            self.calls.append(list(batch))
        assert self.gate.wait(30), "the test never released the write"
        return [True] * len(batch)

    def on_written(self, batch, written) -> None:
        with self.lock:
            self.reported.append((list(batch), list(written)))
            self.written += [item for item, ok in zip(batch, written) if ok]

    def num_calls(self) -> int:
        with self.lock:
            return len(self.calls)


def make_writes(store: GatedStore, max_backlog_bytes: int, batch_bytes: int = 64 << 20) -> RemoteWrites:
    return RemoteWrites(store.write, max_backlog_bytes, store.on_written, batch_bytes=batch_bytes)


def test_offers_beyond_the_backlog_are_dropped_counted_and_never_written():
    """Backlog 3 frames, the store stuck: of 5 offered, 3 are queued and 2 dropped (counted); the backlog
    never passes its bound; once released, exactly the 3 queued are written and the backlog is 0."""
    store = GatedStore()
    writes = make_writes(store, 3 * FRAME)
    try:
        assert writes.offer(items(0, 5)) == 3
        assert writes.num_dropped == 2 and writes.backlog_bytes == 3 * FRAME
        wait_until(lambda: store.num_calls() == 1, timeout_s=10, what="the writer to take the queue")
        assert writes.offer(items(5, 2)) == 0  # in flight counts against the bound too
        assert writes.num_dropped == 4 and writes.backlog_bytes == 3 * FRAME
        store.gate.set()
        assert writes.wait_idle(10)
        assert writes.backlog_bytes == 0
        assert store.written == items(0, 3)
        assert [key for call in store.calls for key, _ in call] == [b"k0", b"k1", b"k2"]
    finally:
        store.gate.set()
        writes.close()


def test_discard_removes_the_queued_writes_it_names_not_the_batch_in_flight():
    """A forget's drop: with k0 in flight and k1..k4 queued, discarding the odd keys leaves k0, k2, k4
    written and the backlog at 0; the number returned is what was removed from the queue."""
    store = GatedStore()
    writes = make_writes(store, 10 * FRAME, batch_bytes=FRAME)
    try:
        assert writes.offer(items(0, 1)) == 1
        wait_until(lambda: store.num_calls() == 1, timeout_s=10, what="the writer to take k0")
        assert writes.offer(items(1, 4)) == 4
        assert writes.discard(lambda key: int(key[1:]) % 2 == 1) == 2
        assert writes.backlog_bytes == 3 * FRAME
        store.gate.set()
        assert writes.wait_idle(10) and writes.backlog_bytes == 0
        assert [key for key, _ in store.written] == [b"k0", b"k2", b"k4"]
    finally:
        store.gate.set()
        writes.close()


def test_a_frame_larger_than_the_whole_backlog_is_dropped_and_smaller_ones_still_fit():
    """A frame that can never fit is dropped on its own; the next ones that fit are queued."""
    store = GatedStore(gated=False)
    writes = make_writes(store, 2 * FRAME)
    try:
        offered = items(0, 1, size=3 * FRAME) + items(1, 2)
        assert writes.offer(offered) == 2 and writes.num_dropped == 1
        assert writes.wait_idle(10) and store.written == offered[1:]
    finally:
        writes.close()


def test_a_zero_backlog_drops_everything():
    """max_write_backlog_bytes 0: writes are off, every frame dropped and counted, nothing written."""
    store = GatedStore(gated=False)
    writes = make_writes(store, 0)
    try:
        assert writes.offer(items(0, 3)) == 0 and writes.num_dropped == 3
        assert writes.wait_idle(10) and store.calls == []
    finally:
        writes.close()


def test_the_backlog_goes_back_to_zero_and_frees_room_for_more():
    """Once the stuck write is released the backlog is 0 and a full backlog's worth is taken again."""
    store = GatedStore()
    writes = make_writes(store, 2 * FRAME)
    try:
        assert writes.offer(items(0, 2)) == 2
        assert writes.offer(items(2, 1)) == 0
        store.gate.set()
        assert writes.wait_idle(10) and writes.backlog_bytes == 0
        assert writes.offer(items(3, 2)) == 2 and writes.num_dropped == 1
        assert writes.wait_idle(10) and writes.backlog_bytes == 0
        assert store.written == items(0, 2) + items(3, 2)
    finally:
        writes.close()


def test_wait_idle_waits_for_the_write_in_flight():
    """wait_idle is False (timed out) while a write is stuck, True once it returned."""
    store = GatedStore()
    writes = make_writes(store, 10 * FRAME)
    try:
        writes.offer(items(0, 1))
        wait_until(lambda: store.num_calls() == 1, timeout_s=10, what="the write to start")
        assert writes.wait_idle(0.05) is False
        assert store.written == []
        store.gate.set()
        assert writes.wait_idle(10) is True and store.written == items(0, 1)
    finally:
        store.gate.set()
        writes.close()


def test_close_writes_what_is_queued_then_refuses_more():
    """close() while a write is stuck and more are queued: it returns only after every queued frame was
    written; offers after close are dropped."""
    store = GatedStore()
    writes = make_writes(store, 10 * FRAME, batch_bytes=FRAME)  # one frame per write call
    assert writes.offer(items(0, 4)) == 4
    wait_until(lambda: store.num_calls() == 1, timeout_s=10, what="the first write to start")
    closer = threading.Thread(target=writes.close)
    closer.start()
    wait_until(lambda: writes._closed, timeout_s=10, what="close() to begin")
    assert writes.offer(items(4, 1)) == 0 and writes.num_dropped == 1
    store.gate.set()
    closer.join(10)
    assert not closer.is_alive()
    assert store.written == items(0, 4) and writes.backlog_bytes == 0
    assert [len(call) for call in store.calls] == [1, 1, 1, 1]


def test_queued_frames_are_batched_up_to_batch_bytes():
    """Frames queued behind a stuck write go out together, at most batch_bytes a call, in order."""
    store = GatedStore()
    writes = make_writes(store, 100 * FRAME, batch_bytes=3 * FRAME)
    try:
        assert writes.offer(items(0, 1)) == 1
        wait_until(lambda: store.num_calls() == 1, timeout_s=10, what="the first write to start")
        assert writes.offer(items(1, 7)) == 7
        store.gate.set()
        assert writes.wait_idle(10)
        assert [len(call) for call in store.calls] == [1, 3, 3, 1]
        assert store.written == items(0, 8)
    finally:
        writes.close()


def test_a_write_that_raises_reports_its_frames_failed_and_the_writer_goes_on():
    """The write function raised: on_written gets all False, the backlog is freed, the next offer is written."""
    store = GatedStore(gated=False)
    failing = {"on": True}

    def write(batch):
        if failing["on"]:
            raise RuntimeError("bug in the store")
        return store.write(batch)

    writes = RemoteWrites(write, 10 * FRAME, store.on_written)
    try:
        assert writes.offer(items(0, 2)) == 2
        assert writes.wait_idle(10) and writes.backlog_bytes == 0
        assert store.reported == [(items(0, 2), [False, False])] and store.written == []
        failing["on"] = False
        assert writes.offer(items(2, 1)) == 1
        assert writes.wait_idle(10) and store.written == items(2, 1)
    finally:
        writes.close()


def test_frames_the_store_did_not_take_are_reported_as_such():
    """write returns per-frame results: on_written sees them as given."""
    results = [True, False, True]
    reported = []
    writes = RemoteWrites(lambda batch: results[:len(batch)], 10 * FRAME, lambda b, w: reported.append(w))
    try:
        writes.offer(items(0, 3))
        assert writes.wait_idle(10) and reported == [results]
    finally:
        writes.close()


# ------------------------------------------------------------------------------------------------ the model


class WritesModel(RuleBasedStateMachine):
    """Offers of random sizes against a stuck store released one write at a time: the backlog is always
    the bytes offered and taken minus those written, never above the bound; an offer takes exactly the
    frames that fit (in order); every frame taken is written once, in order."""

    MAX = 10 * FRAME

    def __init__(self) -> None:
        super().__init__()
        self.store = GatedStore()
        self.store.gate = None  # one gate per write call below
        self.gates: list[threading.Event] = []
        self.writes = RemoteWrites(self._write, self.MAX, self.store.on_written, batch_bytes=4 * FRAME)
        self.backlog = 0
        self.dropped = 0
        self.taken: list[tuple[bytes, bytes]] = []
        self.released_bytes = 0
        self.next_key = 0

    def _write(self, batch):
        gate = threading.Event()
        with self.store.lock:
            self.store.calls.append(list(batch))
            self.gates.append(gate)
        assert gate.wait(30), "never released"
        return [True] * len(batch)

    @rule(sizes=st.lists(st.integers(1, 4 * FRAME), min_size=1, max_size=6))
    def offer(self, sizes) -> None:
        offered = []
        for size in sizes:
            offered.append((b"k%d" % self.next_key, b"x" * size))
            self.next_key += 1
        expected = []
        for key, frame in offered:
            if self.backlog + len(frame) <= self.MAX:
                self.backlog += len(frame)
                expected.append((key, frame))
            else:
                self.dropped += 1
        assert self.writes.offer(offered) == len(expected)
        self.taken += expected

    @precondition(lambda self: self.backlog)
    @rule()
    def release_one_write(self) -> None:
        # Something is queued or in flight: the writer has a write call out, or is about to.
        num_released = len([g for g in self.gates if g.is_set()])
        wait_until(lambda: len(self.gates) > num_released, timeout_s=10, what="the next write call",
                   interval_s=0.001)
        with self.store.lock:
            gate, batch = self.gates[num_released], self.store.calls[num_released]
        nbytes = sum(len(frame) for _, frame in batch)
        gate.set()
        self.backlog -= nbytes
        wait_until(lambda: self.writes.backlog_bytes == self.backlog, timeout_s=10, what="the backlog to drop",
                   interval_s=0.001)

    @invariant()
    def bounded_and_counted(self) -> None:
        assert self.writes.backlog_bytes == self.backlog <= self.MAX
        assert self.writes.num_dropped == self.dropped

    def teardown(self) -> None:
        while self.backlog:
            self.release_one_write()
        assert self.writes.wait_idle(10)
        self.writes.close()
        assert self.store.written == self.taken
        assert all(sum(len(f) for _, f in call) <= 4 * FRAME or len(call) == 1 for call in self.store.calls)


TestWritesModel = WritesModel.TestCase
TestWritesModel.settings = settings(stateful_step_count=20)
