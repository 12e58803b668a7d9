"""Which lower-tier hits are worth loading: per request, per tier, in chain order.

A request's leading blocks in T0 are always taken. Then, for each lower tier in chain order
(T1, T2, T3), its blocks are loaded only while the expected time to bring them into T0 is below
the expected time to recompute their tokens; past the first tier that is declined nothing
further is loaded (a prefix breaks once: the engine computes from there). Storage hits slower
than recompute are a documented failure of peers (SGLang #26305, #31600).

- Expected load time: the tier's path into T0 (LowerTier.load_path: each hop's bytes over that
  hop's measured bandwidth, the median of its recent copies (copy_engine.Bandwidth); T1: host →
  device; T2: SSD read, then host → device; T3: the store's reads, then host → device). A hop
  measured fewer than MIN_SAMPLES times costs nothing here: neither its first guess (copy engine
  5 GB/s on the CPU, 20 GB/s over PCIe, SSD reads 2 GB/s, T3 reads 0.5 GB/s) nor one or two
  copies (a single stalled one on a loaded node) decline a tier; the loads measure it.
- Expected recompute time: the tokens times the layout's recompute cost (recompute_cost.py: the
  engines' measured prefill, or policy.recompute_s_per_token). Unknown: every hit is loaded.

A declined tier is measured again now and then, at most every REMEASURE_INTERVAL_S per layout
and tier (`Remeasures`), so a path that was slow once is not shunned for ever: a declined hit
from below T1 is read into T1 in the background (never waited for by the request, which
recomputes); T1's path (host → device) is measured by every upload from any tier, and when T1
itself is declined (then every tier below is, and nothing uploads) its hit is loaded anyway once
an interval: that load is the measurement.

The decision is made where the engine is promised its hit: a Lookup answers which trailing
blocks of its hit are declined (LookupResponse.num_declined_blocks), and an Acquire that loads
what a Lookup promised (AcquireRequest.load_every_hit) is not weighed again, so a promise is
never broken for cost. An Acquire without a Lookup weighs its own hits the same way.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

from kvtierd.movers.copy_engine import Bandwidth
from kvtierd.tier import LOWER_TIERS, Tier, TierCounts

# One hop of a load into T0: its bandwidth estimate and the bytes that cross it.
Hop = tuple[Bandwidth, int]
REMEASURE_INTERVAL_S = 60.0  # the least time between two background reads of one declined tier
MIN_SAMPLES = 3  # a hop's copies measured before its bandwidth can decline a tier


def expected_load_s(path: Sequence[Hop]) -> float:
    """Seconds to move the path's bytes, hop after hop, at the hops' measured bandwidths (a hop
    measured fewer than MIN_SAMPLES times counts 0 s)."""
    return sum(bandwidth.seconds_for(nbytes) for bandwidth, nbytes in path if bandwidth.num_samples >= MIN_SAMPLES)


def worth_loading(num_tokens: int, path: Sequence[Hop], recompute_s_per_token: float | None) -> bool:
    """Is moving these bytes along `path` expected to be faster than recomputing `num_tokens`
    at `recompute_s_per_token` (None: unknown, always load)?"""
    if recompute_s_per_token is None or num_tokens == 0:
        return True
    return expected_load_s(path) < num_tokens * recompute_s_per_token


def declined(hits: TierCounts, load_path: Callable[[Tier, int], Sequence[Hop]], block_size: int,
             recompute_s_per_token: float | None, load_anyway: Callable[[Tier], bool] = lambda tier: False,
             ) -> TierCounts:
    """The blocks of a chain's `hits` not to load: none, or every lower-tier block from the first
    tier whose load (`load_path(tier, its hits)`) is slower than recomputing its tokens on, unless
    `load_anyway(that tier)` (asked only of a tier about to be declined: T1's remeasure)."""
    if recompute_s_per_token is None:
        return TierCounts()
    for tier in LOWER_TIERS:
        num_blocks = hits[tier]
        if num_blocks and not worth_loading(num_blocks * block_size, load_path(tier, num_blocks),
                                            recompute_s_per_token) and not load_anyway(tier):
            return from_tier(hits, tier)
    return TierCounts()


def from_tier(hits: TierCounts, tier: Tier) -> TierCounts:
    """`hits`' blocks in `tier` and the tiers below it (a prefix broken at `tier`)."""
    return TierCounts(*(count if t.level >= tier.level else 0 for t, count in hits.items()))


class Remeasures:
    """When a declined tier is due to be read again in the background, to measure its path anew.
    Thread-safe; the first is due an interval after it was made (a tier is declined only once
    measured, so just measured)."""

    def __init__(self, interval_s: float = REMEASURE_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self._last_s: dict[Tier, float] = dict.fromkeys(LOWER_TIERS, time.monotonic())
        self._lock = threading.Lock()

    def t1_due(self, tier: Tier) -> bool:
        """Whether a declined `tier` is loaded anyway now: T1 when due (its load measures the
        host → device path that every tier's load ends with); never a tier below it."""
        return tier is Tier.T1 and self.due(tier)

    def due(self, tier: Tier) -> bool:
        """Whether `tier` is due (and, if so, it is not again for an interval)."""
        now = time.monotonic()
        with self._lock:
            if now - self._last_s[tier] < self.interval_s:
                return False
            self._last_s[tier] = now
            return True
