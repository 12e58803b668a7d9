"""A histogram for the block index's hot path: bucket counts and a sum, observed a batch at a
time under the index's lock, read at scrape time.

prometheus_client's Histogram takes a lock and walks its buckets for every value: about 2 µs,
paid once per reused block (256 times for a 4k-token prompt hit) under the index lock. Here a
batch costs one bisect per value, or one numpy searchsorted for a large batch.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import numpy as np
from prometheus_client.utils import floatToGoString

NUMPY_MIN_BATCH = 16  # below this, bisect per value is faster than numpy's fixed cost


class BucketHistogram:
    """Counts of values per bucket `value <= upper_bounds[i]` (first match), then +Inf.

    Not locked: observe from one thread at a time (the block index holds its lock); a scrape
    reading while a batch lands may see the counts of that batch without its sum, never a count
    going backwards.
    """

    def __init__(self, upper_bounds: Sequence[float]) -> None:
        assert list(upper_bounds) == sorted(upper_bounds), upper_bounds
        self.upper_bounds = tuple(float(b) for b in upper_bounds)
        self._bounds = np.asarray(self.upper_bounds)
        self.counts = np.zeros(len(self.upper_bounds) + 1, dtype=np.int64)  # the last: +Inf
        self.sum = 0.0

    def observe_many(self, values: Sequence[float]) -> None:
        if len(values) < NUMPY_MIN_BATCH:
            counts, bounds = self.counts, self.upper_bounds
            for value in values:
                counts[bisect.bisect_left(bounds, value)] += 1
            self.sum += sum(values)
            return
        array = np.asarray(values, dtype=np.float64)
        self.counts += np.bincount(np.searchsorted(self._bounds, array, side="left"), minlength=len(self.counts))
        self.sum += float(array.sum())

    @property
    def count(self) -> int:
        return int(self.counts.sum())

    def cumulative(self) -> list[tuple[str, int]]:
        """(le, cumulative count) pairs as Prometheus exposes them, +Inf last."""
        totals = np.cumsum(self.counts).tolist()
        return [(floatToGoString(bound), total)
                for bound, total in zip(self.upper_bounds, totals)] + [("+Inf", totals[-1])]
