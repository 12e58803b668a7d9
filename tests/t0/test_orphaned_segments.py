"""Segments a killed kvtierd process left in /dev/shm are removed at the next start; a live
process's segments (and a fresh one, whose creator may not hold its lock yet) are never touched."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys

from kvtierd.t0.shm_segment import ShmSegment, default_segment_name, remove_orphaned_segments

CREATE_AND_WAIT = """
import sys
from kvtierd.t0.shm_segment import ShmSegment
segment = ShmSegment.create(1 << 20, sys.argv[1])
print("created", flush=True)
sys.stdin.read()  # until killed
"""


def killed_creator_segment(name: str) -> str:
    """A segment whose creating process was SIGKILLed: its file stays, nobody holds its lock."""
    child = subprocess.Popen([sys.executable, "-P", "-c", CREATE_AND_WAIT, name], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "created"
    child.send_signal(signal.SIGKILL)
    child.wait(30)
    path = f"/dev/shm/{name}"
    assert os.path.exists(path)
    return path


def test_only_the_segments_of_killed_processes_are_removed():
    orphan = killed_creator_segment(default_segment_name("pool"))
    live = ShmSegment.create(1 << 20, default_segment_name("host"))
    try:
        remove_orphaned_segments()  # the default min_age_s: a segment of a second ago is left alone
        assert os.path.exists(orphan)
        num_removed, nbytes = remove_orphaned_segments(min_age_s=0)
        assert not os.path.exists(orphan) and os.path.exists(live.path)
        assert num_removed >= 1 and nbytes >= 1 << 20
        assert ShmSegment.attach(live.name, 1 << 20).nbytes == 1 << 20  # the live one still attaches by name
    finally:
        live.close()
        if os.path.exists(orphan):
            os.unlink(orphan)


def test_a_segment_whose_descriptor_a_runner_holds_is_not_an_orphan():
    """The creator died but a runner still holds a descriptor of it (a passed descriptor shares the
    creator's lock; here a shared lock of its own): the memory is in use, the name stays."""
    path = killed_creator_segment(default_segment_name("pool"))
    holder = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(holder, fcntl.LOCK_SH)
        remove_orphaned_segments(min_age_s=0)
        assert os.path.exists(path)
    finally:
        os.close(holder)
    remove_orphaned_segments(min_age_s=0)
    assert not os.path.exists(path)
