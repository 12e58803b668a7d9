"""A real daemon whose T2 reads are slow on purpose (tests/server/slow_t2_serve.py), with a client."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from kvtierd.client import KvtierClient
from kvtierd.launch.daemon_process import WRITE_THROUGH, DaemonProcess, small_daemon_args

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@contextlib.contextmanager
def slow_t2_daemon(directory: str, read_delay_s: float) -> Iterator[tuple[DaemonProcess, KvtierClient]]:
    """`kvtierd serve` (write-through, small tiers) sleeping `read_delay_s` before each read of a run
    of SSD slots, and a client of it."""
    env = {"SLOW_T2_READ_DELAY_S": str(read_delay_s), "PYTHONPATH": REPO}
    with DaemonProcess(small_daemon_args(directory, extra=WRITE_THROUGH), env=env,
                       module="tests.server.slow_t2_serve") as daemon, KvtierClient(daemon.address) as client:
        yield daemon, client
