"""SerialBatches: one batch at a time; the pieces that come while one runs are the next batch, up to its
size; a batch that ends at once (inside `run`) or raises still lets the next one start."""

from __future__ import annotations

import threading

import pytest

from kvtierd.tiering.serial_batches import SerialBatches


class Recorder:
    """A `run` that records each batch and keeps its `done` for the test to call (or calls it at once)."""

    def __init__(self, end_at_once: bool = False) -> None:
        self.batches: list[list[int]] = []
        self.dones: list = []
        self.end_at_once = end_at_once

    def __call__(self, batch: list[int], done) -> None:
        self.batches.append(batch)
        if self.end_at_once:
            done()
        else:
            self.dones.append(done)


def test_pieces_that_come_while_a_batch_runs_go_together_in_the_next():
    run = Recorder()
    batches = SerialBatches(run, size=lambda piece: 1, max_size=100)
    batches.add(1)
    assert run.batches == [[1]]  # the edge was idle: at once
    for piece in (2, 3, 4):
        batches.add(piece)
    assert run.batches == [[1]]  # queued behind the running batch
    run.dones.pop(0)()
    assert run.batches == [[1], [2, 3, 4]]
    run.dones.pop(0)()
    batches.add(5)
    assert run.batches == [[1], [2, 3, 4], [5]] and batches.num_batches == 3


def test_a_batch_stops_at_max_size_but_always_takes_one_piece():
    run = Recorder()
    batches = SerialBatches(run, size=lambda piece: piece, max_size=10)
    for piece in (1, 4, 5, 3, 20, 2):
        batches.add(piece)
    while run.dones:
        run.dones.pop(0)()
    assert run.batches == [[1], [4, 5], [3], [20], [2]]


def test_batches_that_end_inside_run_do_not_recurse():
    """5,000 pieces queued behind a running batch, each then its own batch that ends inside `run`: a
    recursive start of the next batch would pass Python's recursion limit."""
    run = Recorder(end_at_once=True)
    started, release = threading.Event(), threading.Event()

    def first(batch, done):  # the first batch ends on another thread, when the test says so
        run.batches.append(batch)
        started.set()
        threading.Thread(target=lambda: (release.wait(10), done())).start()

    batches = SerialBatches(first, size=lambda piece: 1, max_size=1)
    batches.add(-1)
    assert started.wait(10)
    batches._run = run
    for piece in range(5000):
        batches.add(piece)
    assert len(run.batches) == 1  # all queued behind the first
    ended = threading.Event()
    batches._run = lambda batch, done: (run(batch, done), batch == [4999] and ended.set())
    release.set()
    assert ended.wait(30)
    assert len(run.batches) == 5001 and run.batches[-1] == [4999]


def test_a_run_that_raises_ends_its_batch_and_the_next_one_starts(caplog):
    calls: list[list[int]] = []

    def run(batch, done):
        calls.append(batch)
        if batch == [1]:
            raise RuntimeError("engine closed")
        done()

    batches = SerialBatches(run, size=lambda piece: 1, max_size=10)
    batches.add(1)
    batches.add(2)
    assert calls == [[1], [2]] and "failed to start" in caplog.text


def test_done_twice_is_an_error():
    run = Recorder()
    batches = SerialBatches(run, size=lambda piece: 1, max_size=1)
    batches.add(1)
    done = run.dones.pop()
    done()
    with pytest.raises(AssertionError, match="ended twice"):
        done()
