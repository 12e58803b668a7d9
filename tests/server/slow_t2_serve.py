"""`kvtierd serve` whose T2 is slow: each slot-file write sleeps SLOW_T2_WRITE_DELAY_S first, and
each read of a run of slots SLOW_T2_READ_DELAY_S (either unset: 0, that side as it is). With
SLOW_T2_THREADS_FILE, each slow write appends a line to that file: "loop" where it ran on a thread
running an asyncio event loop (the daemon's loop waiting on the disk), else "worker".

The faults a dying or contended disk shows: a slow write must never stall the daemon's loop
(tests/server/test_loop_never_blocks.py), a slow read must not be loaded when recomputing is
faster (tests/connectors/reference/test_reference_runner_slow_tier.py). Run as
`python -P -m tests.server.slow_t2_serve serve ...` with the repository on PYTHONPATH.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time

from kvtierd.cli.kvtierd_main import main
from kvtierd.t2.ssd_files import SlotFiles

WRITE_DELAY_S = float(os.environ.get("SLOW_T2_WRITE_DELAY_S", "0"))
READ_DELAY_S = float(os.environ.get("SLOW_T2_READ_DELAY_S", "0"))
THREADS_FILE = os.environ.get("SLOW_T2_THREADS_FILE")
_write_run, _read_run = SlotFiles.write_run, SlotFiles.read_run


def slow_write_run(self, run, sources) -> None:
    if THREADS_FILE:
        with open(THREADS_FILE, "a") as threads:
            threads.write(("loop" if _on_event_loop() else "worker") + "\n")
    time.sleep(WRITE_DELAY_S)
    _write_run(self, run, sources)


def _on_event_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def slow_read_run(self, run, destinations):
    time.sleep(READ_DELAY_S)
    return _read_run(self, run, destinations)


if WRITE_DELAY_S:
    SlotFiles.write_run = slow_write_run
if READ_DELAY_S:
    SlotFiles.read_run = slow_read_run

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
