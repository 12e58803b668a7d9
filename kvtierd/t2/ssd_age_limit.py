"""The SSD tier's age limit (retention.max_age_s): a block stored longer ago than the limit is a
miss and its slot is reclaimed.

The time of a block's store is kept in its index record (wall clock), so a restart neither resets
nor forgets it. A load never hands out a block past the limit (its prefix ends there) and drops
what it found aged; the daemon's sweep drops the rest, at most every `max_age_s / 16` seconds (at
least every second), so a Lookup may still count an aged block as a T2 hit until then (its load
then fails and the engine recomputes). Without a limit (0) nothing here runs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from kvtierd.index.slot_entry import SlotEntry

MIN_SCAN_INTERVAL_S = 1.0
SCANS_PER_MAX_AGE = 16


class AgeLimit:
    """When blocks are too old, by `clock` (the tier index's: wall clock). `max_age_s` 0 = no limit.
    Invariant: `num_fresh` never counts an entry stored before `cutoff_s()`."""

    def __init__(self, max_age_s: float, clock: Callable[[], float] = time.time) -> None:
        assert max_age_s >= 0, max_age_s
        self.max_age_s = max_age_s
        self._clock = clock
        self._next_scan_s = 0.0  # on `clock`; read and set by the sweep's thread only

    @property
    def enabled(self) -> bool:
        return self.max_age_s > 0

    def cutoff_s(self) -> float:
        """Blocks stored before this are past the limit."""
        return self._clock() - self.max_age_s if self.enabled else float("-inf")

    def num_fresh(self, entries: Sequence[SlotEntry]) -> int:
        """How many leading entries are within the limit."""
        cutoff_s = self.cutoff_s()
        return next((i for i, entry in enumerate(entries) if entry.stored_s < cutoff_s), len(entries))

    def scan_due(self) -> bool:
        """Is it time for the sweep to look for aged blocks again (and if so, the next is scheduled)?"""
        now = self._clock()
        if not self.enabled or now < self._next_scan_s:
            return False
        self._next_scan_s = now + max(MIN_SCAN_INTERVAL_S, self.max_age_s / SCANS_PER_MAX_AGE)
        return True

    def aged(self, entries: Sequence[SlotEntry]) -> list[SlotEntry]:
        """The stored (not being stored) entries past the limit."""
        cutoff_s = self.cutoff_s()
        return [entry for entry in entries if not entry.storing and entry.stored_s < cutoff_s]
