"""The blocks the SSD tier drops instead of serving, and their counts: reads that failed ("io"),
did not verify ("corrupt") or did not open as their own key's ("unauthentic"), and blocks past the
age limit (ssd_age_limit.py). A dropped block leaves the slot index and LMDB in one step under the
tier's write lock (ssd_tier.py's write order), and is counted by why.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterable, Sequence

from kvtierd.daemon_key import DaemonKey
from kvtierd.index.extent_slot_index import ExtentSlotIndex
from kvtierd.index.residency import LeaveReason
from kvtierd.index.slot_entry import SlotEntry
from kvtierd.t2.ssd_age_limit import AgeLimit

log = logging.getLogger(__name__)


class SsdDrops:
    """Drops and their counters for one SSD tier. Thread-safe (counters under `_lock`).

    `commit_deletes(where, hashes)` deletes LMDB records; it is called with `write_lock` held, as is
    every removal from `index` here, so no slot freed here is written before its record is gone."""

    def __init__(self, index: ExtentSlotIndex, write_lock: threading.Lock,
                 commit_deletes: Callable[[str, Iterable[DaemonKey]], object],
                 operation: Callable[[], contextlib.AbstractContextManager], max_age_s: float) -> None:
        self._index = index
        self._write_lock = write_lock
        self._commit_deletes = commit_deletes
        self._operation = operation
        self.age_limit = AgeLimit(max_age_s)
        self._lock = threading.Lock()
        self.num_corrupted = self.num_io_errors = 0  # under _lock
        self.num_unauthentic = 0  # sealed records that did not open as their key's: moved, altered, forgotten
        self.num_aged_out = 0  # blocks dropped for being older than config.max_age_s

    def expire_aged(self) -> int:
        """The sweep's call: drop the blocks older than the age limit, when a scan is due
        (ssd_age_limit.py); returns how many went."""
        if not self.age_limit.scan_due():
            return 0
        with self._operation():
            return self.drop_aged()

    def drop_aged(self) -> int:
        aged = [e.block_hash for e in self.age_limit.aged(self._index.entries())]
        if not aged:
            return 0
        with self._write_lock:
            removed = self._index.remove(aged, LeaveReason.EXPIRED)
            self._commit_deletes("age limit", [e.block_hash for e in removed])
        with self._lock:
            self.num_aged_out += len(removed)
        return len(removed)

    def drop(self, failures: list[tuple[SlotEntry, str]]) -> None:
        """Drop blocks that failed to read or verify (one another load pins: when that load fails too)."""
        if not failures:
            return
        why = {entry.block_hash: reason for entry, reason in failures}
        with self._write_lock:
            removed = self._index.remove(list(why))
            self._commit_deletes("drop", [e.block_hash for e in removed])
        self.count_lost([why[e.block_hash] for e in removed])

    def count_lost(self, reasons: Sequence[str]) -> None:
        """Blocks dropped because they failed to read ("io"), verify ("corrupt") or open ("unauthentic")."""
        num_io = sum(1 for why in reasons if why == "io")
        num_unauthentic = sum(1 for why in reasons if why == "unauthentic")
        with self._lock:
            self.num_io_errors += num_io
            self.num_unauthentic += num_unauthentic
            self.num_corrupted += len(reasons) - num_io - num_unauthentic
        if reasons:
            log.warning("SSD tier: dropped %d block(s) that failed to read (%d), verify (%d) or open as their own "
                        "key's (%d)", len(reasons), num_io, len(reasons) - num_io - num_unauthentic, num_unauthentic)

    def count_io_error(self) -> None:
        """A write or index error (it stopped admission)."""
        with self._lock:
            self.num_io_errors += 1
