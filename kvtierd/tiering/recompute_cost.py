"""What recomputing one prompt token costs a layout's engines: the figure a lower-tier hit must
beat to be loaded (load_decision.py).

Engines measure their own prefill (the tokens of their prefill forwards over the seconds those
took, an exponentially weighted moving average) and report it on their Acquires
(AcquireRequest.recompute_s_per_token). A layout is one model's KV on this node, so its cost is
one figure for every engine of that model: the reports of all of them, folded into one moving
average here. The operator's `policy.recompute_s_per_token`, when set, overrides the
measurement (it wins, reports are still kept for the stats). With neither, the cost is unknown
and every lower-tier hit is loaded.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import threading

from kvtierd.errors import InvalidArgument


class CostSource(enum.StrEnum):
    """Where a layout's recompute cost comes from (the Stats RPC's `recompute_source`)."""

    UNKNOWN = ""  # no report and no override: every lower-tier hit is loaded
    MEASURED = "measured"  # the engines' reports
    POLICY = "policy"  # policy.recompute_s_per_token (the operator's override)


@dataclasses.dataclass(frozen=True, slots=True)
class CostEstimate:
    """The cost in use and where it comes from; `s_per_token` is None when unknown."""

    s_per_token: float | None
    source: CostSource
    num_reports: int  # engines' reports folded in since start (also under an override)


def check_report(s_per_token: float) -> float:
    """An engine's report as the wire carries it: 0 (not measured yet) or a finite positive
    number of seconds; anything else is refused."""
    if not (math.isfinite(s_per_token) and s_per_token >= 0):
        raise InvalidArgument(f"recompute_s_per_token must be a finite number >= 0 (0: not measured), "
                              f"got {s_per_token!r}")
    return s_per_token


class RecomputeCost:
    """One layout's seconds to recompute a prompt token. Thread-safe.

    Invariants: `_measured_s` is None until the first report, then the moving average of every
    report (the first taken as is); `override_s`, when not None, is positive and is the cost."""

    def __init__(self, override_s: float | None = None, weight: float = 0.2) -> None:
        assert override_s is None or override_s > 0, override_s  # TierConfig checks the operator's value
        assert 0 < weight <= 1, weight
        self.override_s = override_s
        self.weight = weight
        self._measured_s: float | None = None
        self._num_reports = 0
        self._lock = threading.Lock()

    def report(self, s_per_token: float) -> None:
        """Fold in an engine's measurement (0: it has none yet, ignored); a bad value is refused."""
        if not check_report(s_per_token):
            return
        with self._lock:
            measured = self._measured_s
            self._measured_s = s_per_token if measured is None else (
                self.weight * s_per_token + (1 - self.weight) * measured)
            self._num_reports += 1

    @property
    def s_per_token(self) -> float | None:
        """The cost a hit must beat: the override, else the measurement, else None (load every hit)."""
        return self.override_s if self.override_s is not None else self._measured_s

    def estimate(self) -> CostEstimate:
        with self._lock:
            measured, num_reports = self._measured_s, self._num_reports
        if self.override_s is not None:
            return CostEstimate(self.override_s, CostSource.POLICY, num_reports)
        return CostEstimate(measured, CostSource.MEASURED if measured is not None else CostSource.UNKNOWN,
                            num_reports)
