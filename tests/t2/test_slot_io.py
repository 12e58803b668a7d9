"""SlotIO's runs: the caller's thread does the last run itself (a write of one run hands nothing to
the I/O threads), the others run on the I/O threads, and the bytes read back are the bytes written."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from kvtierd.index.slot_entry import BlockMeta, SlotEntry
from kvtierd.t2.ssd_files import SlotFiles
from kvtierd.t2.ssd_io import SlotIO

SLOT_NBYTES = 4096
NUM_SLOTS = 16


@pytest.fixture
def slot_io(tmp_path):
    files = SlotFiles([str(tmp_path)], NUM_SLOTS * SLOT_NBYTES, SLOT_NBYTES, o_direct=False)
    io = SlotIO(files, 2, np.zeros(files.max_slots, dtype=np.uint64))
    yield io
    io.close()


def entries_at(slots: list[int]) -> list[SlotEntry]:
    return [SlotEntry(BlockMeta(bytes([slot]) * 16, b"\0" * 16, b""), slot, storing=False) for slot in slots]


def threads_of_runs(io: SlotIO) -> list[str]:
    """Records the thread that writes each run from now on."""
    names: list[str] = []
    write_run = io.files.write_run

    def recorded(run, sources):
        names.append(threading.current_thread().name)
        write_run(run, sources)

    io.files.write_run = recorded  # type: ignore[method-assign]
    return names


def test_a_write_of_one_run_runs_on_the_calling_thread_and_reads_back(slot_io):
    names = threads_of_runs(slot_io)
    entries = entries_at([3, 4, 5])  # consecutive slots: one run
    blocks = [os.urandom(SLOT_NBYTES) for _ in entries]
    checksums = slot_io.write(entries, [memoryview(b) for b in blocks])
    assert names == [threading.current_thread().name]
    slot_io.checksums[[3, 4, 5]] = checksums
    out = [memoryview(bytearray(SLOT_NBYTES)) for _ in entries]
    assert slot_io.read(entries, out) == [True, True, True]
    assert [bytes(o) for o in out] == blocks


def test_a_write_of_three_runs_puts_two_on_the_io_threads_and_keeps_every_block_in_its_slot(slot_io):
    names = threads_of_runs(slot_io)
    entries = entries_at([9, 1, 5])  # three runs, given out of slot order
    blocks = [os.urandom(SLOT_NBYTES) for _ in entries]
    slot_io.checksums[[9, 1, 5]] = slot_io.write(entries, [memoryview(b) for b in blocks])
    assert sorted(n.startswith("kvtierd-ssd-io") for n in names) == [False, True, True]
    out = [memoryview(bytearray(SLOT_NBYTES)) for _ in entries]
    assert slot_io.read(entries, out) == [True, True, True]
    assert [bytes(o) for o in out] == blocks


def test_a_run_that_fails_on_the_calling_thread_raises_after_the_others_finished(slot_io):
    finished: list[int] = []
    write_run = slot_io.files.write_run

    def failing_on_caller(run, sources):
        if not threading.current_thread().name.startswith("kvtierd-ssd-io"):
            raise OSError(5, "injected")
        write_run(run, sources)
        finished.append(run.first_local_slot)

    slot_io.files.write_run = failing_on_caller  # type: ignore[method-assign]
    entries = entries_at([0, 6, 12])
    with pytest.raises(OSError, match="injected"):
        slot_io.write(entries, [memoryview(os.urandom(SLOT_NBYTES)) for _ in entries])
    assert len(finished) == 2  # the I/O threads' runs were waited for before the error came out
