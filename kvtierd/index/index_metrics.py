"""Metrics hooks of the block index, and an in-process recorder of them.

The index calls an IndexObserver at each event an operator plans with: prefix queries and hits
(in tokens), evictions with the block's lifetime and its idle time before eviction (release to
eviction), and the reuse gap of every hit on a released block (release to reuse). Hits on blocks
still in use are sharing, not reuse: they never competed with eviction and are not counted.
Reuse-gap p90 above idle-before-evict p50 means blocks are evicted before they would have been
reused: the pool is too small (vLLM's kv_block_* metrics make the same reading).
The daemon plugs in a Prometheus observer; `IndexStats` keeps them in process.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Sequence
from typing import Protocol


class IndexObserver(Protocol):
    """What the block index reports. Called under the index lock: keep it cheap, never re-enter."""

    def on_query(self, num_query_tokens: int, num_hit_tokens: int) -> None: ...

    def on_evict(self, lifetimes_s: Sequence[float], idles_s: Sequence[float]) -> None:
        """Blocks evicted together: per block, time since commit and since last release."""

    def on_reuse(self, gaps_s: Sequence[float]) -> None:
        """Released blocks taken again by one prefix hit: per block, time since its release."""


class Samples:
    """The last `capacity` values of a distribution, with percentiles (nearest rank)."""

    def __init__(self, capacity: int = 65536) -> None:
        self.values: collections.deque[float] = collections.deque(maxlen=capacity)
        self.count = 0

    def add(self, value: float) -> None:
        self.values.append(value)
        self.count += 1

    def percentile(self, q: float) -> float:
        """The q-th percentile (0 < q <= 100) of the kept values; nan when there are none."""
        if not self.values:
            return math.nan
        ordered = sorted(self.values)
        rank = max(1, math.ceil(q / 100 * len(ordered)))
        return ordered[rank - 1]


class IndexStats:
    """An IndexObserver that counts and keeps samples in process."""

    def __init__(self) -> None:
        self.num_query_tokens = 0
        self.num_hit_tokens = 0
        self.num_evictions = 0
        self.lifetime_s = Samples()
        self.idle_before_evict_s = Samples()
        self.reuse_gap_s = Samples()

    def on_query(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        self.num_query_tokens += num_query_tokens
        self.num_hit_tokens += num_hit_tokens

    def on_evict(self, lifetimes_s: Sequence[float], idles_s: Sequence[float]) -> None:
        self.num_evictions += len(lifetimes_s)
        for lifetime_s, idle_s in zip(lifetimes_s, idles_s):
            self.lifetime_s.add(lifetime_s)
            self.idle_before_evict_s.add(idle_s)

    def on_reuse(self, gaps_s: Sequence[float]) -> None:
        for gap_s in gaps_s:
            self.reuse_gap_s.add(gap_s)

    @property
    def hit_rate(self) -> float:
        """Hit tokens over queried tokens (0 when nothing was queried)."""
        return self.num_hit_tokens / self.num_query_tokens if self.num_query_tokens else 0.0

    def pool_too_small(self) -> bool:
        """Reuse-gap p90 above idle-before-evict p50: blocks leave before they are reused."""
        if not self.reuse_gap_s.values or not self.idle_before_evict_s.values:
            return False
        return self.reuse_gap_s.percentile(90) > self.idle_before_evict_s.percentile(50)
