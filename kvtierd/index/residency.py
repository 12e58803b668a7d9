"""How long blocks stayed in a tier, and why they left: one `Residency` per tier index.

A block's residency runs from entering the tier (T0: its commit; T1, T2: the slot's store) to
leaving it, and the tier's index records it at that instant, under its own lock, as one float:
a bucket count and a sum per reason. Why it left (`LeaveReason`):
- `flushed`: an operator's evict, flush or forget, a reset, a corrupt block dropped: the caller
  names it;
- else the tier's `classify` (set by the tiering layer, tiering/leave_reasons.py), which knows the
  edges below and the retention hints: `demoted` (sent down to the tier below: an edge that copies
  down, or a retention hint), `expired` (a retention hint that covered it lapsed while it was
  here, and nothing took it down), `evicted` (dropped for room, no copy sent below).
Reading (`snapshot`) takes no lock: a scrape may see a count without its sum, never a count
going back.
"""

from __future__ import annotations

import bisect
import dataclasses
import enum
import math
from collections.abc import Callable, Mapping

from kvtierd.daemon_key import DaemonKey


class LeaveReason(enum.StrEnum):
    """Why a block left a tier (a metric label, a proto string)."""

    EVICTED = "evicted"  # dropped for room, not copied down
    DEMOTED = "demoted"  # copied down to the tier below as it left (an edge's policy or a retention hint)
    EXPIRED = "expired"  # dropped after the retention hint that kept it lapsed
    FLUSHED = "flushed"  # an operator's evict / flush / forget, a reset, a corrupt block


# Residency buckets: 100 ms (a block evicted by the next request) to a day; longer ones land in +Inf.
RESIDENCY_BUCKETS_S = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0,
                       7200.0, 14400.0, 43200.0, 86400.0)

# (block key, seconds it stayed) → why it left, when the caller does not name the reason
Classify = Callable[[DaemonKey, float], LeaveReason]


def _evicted(key: DaemonKey, resident_s: float) -> LeaveReason:
    return LeaveReason.EVICTED


@dataclasses.dataclass(frozen=True, slots=True)
class ResidencyCounts:
    """The blocks that left a tier for one reason: per bucket (`value <= RESIDENCY_BUCKETS_S[i]`,
    then +Inf) and the sum of their residencies."""

    bucket_counts: tuple[int, ...]
    sum_s: float

    @property
    def num_blocks(self) -> int:
        return sum(self.bucket_counts)


@dataclasses.dataclass(frozen=True, slots=True)
class ResidencySnapshot:
    """One tier's residencies so far, by reason (every reason present, zeros included)."""

    by_reason: Mapping[LeaveReason, ResidencyCounts]

    @property
    def num_blocks(self) -> int:
        return sum(counts.num_blocks for counts in self.by_reason.values())

    def percentile_s(self, q: float) -> float:
        """The q-th percentile (0 < q <= 100) over every reason, interpolated within its bucket as
        Prometheus' histogram_quantile does (nan without blocks; the last bound past it)."""
        totals = [sum(column) for column in zip(*(c.bucket_counts for c in self.by_reason.values()))]
        num_blocks = sum(totals)
        if not num_blocks:
            return math.nan
        rank = q / 100 * num_blocks
        below = 0
        for i, count in enumerate(totals):
            if count and below + count >= rank:
                if i == len(RESIDENCY_BUCKETS_S):
                    return RESIDENCY_BUCKETS_S[-1]
                lower = RESIDENCY_BUCKETS_S[i - 1] if i else 0.0
                return lower + (RESIDENCY_BUCKETS_S[i] - lower) * (rank - below) / count
            below += count
        return RESIDENCY_BUCKETS_S[-1]


class Residency:
    """Residency counts of one tier, by reason. Written only under the owning index's lock (one
    writer at a time), one bisect and two additions a block; `classify` is set once, before use."""

    __slots__ = ("classify", "_counts", "_sums")

    def __init__(self) -> None:
        self.classify: Classify = _evicted
        self._counts = {reason: [0] * (len(RESIDENCY_BUCKETS_S) + 1) for reason in LeaveReason}
        self._sums = dict.fromkeys(LeaveReason, 0.0)

    def left(self, key: DaemonKey, resident_s: float, reason: LeaveReason | None = None) -> None:
        """A block left after `resident_s` seconds; `reason` None: the tier's `classify` says why."""
        if reason is None:
            reason = self.classify(key, resident_s)
        self._counts[reason][bisect.bisect_left(RESIDENCY_BUCKETS_S, resident_s)] += 1
        self._sums[reason] += resident_s

    def snapshot(self) -> ResidencySnapshot:
        return ResidencySnapshot({reason: ResidencyCounts(tuple(self._counts[reason]), self._sums[reason])
                                  for reason in LeaveReason})
