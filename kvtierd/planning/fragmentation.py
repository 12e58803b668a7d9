"""Internal fragmentation of a paged pool for a length distribution, with both denominators.

A request of L tokens occupies ceil(L / B) blocks = slots tokens; the last block's empty slots
are the waste. The same waste reads very differently against the two denominators (seed 003):
34-token requests at block 16 occupy 48 slots, 14 wasted: 14/48 ≈ 29% of allocated slots but
14/34 ≈ 41% of effective tokens; 200-token requests waste 8/208 ≈ 3.8% per slot. A figure of
waste is never reported without saying which of the two it is.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping

from kvtierd.errors import InvalidArgument
from kvtierd.units import round_up


def num_slots(num_tokens: int, block_size: int) -> int:
    """Token slots a request of `num_tokens` occupies: whole blocks."""
    return round_up(num_tokens, block_size)


@dataclasses.dataclass(frozen=True, slots=True)
class Fragmentation:
    """Waste of one block size over a set of requests."""

    block_size: int
    num_requests: int
    num_effective_tokens: int
    num_allocated_slots: int

    @property
    def num_wasted_slots(self) -> int:
        return self.num_allocated_slots - self.num_effective_tokens

    @property
    def waste_per_effective_token(self) -> float:
        return self.num_wasted_slots / self.num_effective_tokens if self.num_effective_tokens else 0.0

    @property
    def waste_per_allocated_slot(self) -> float:
        return self.num_wasted_slots / self.num_allocated_slots if self.num_allocated_slots else 0.0

    def describe(self) -> str:
        return (f"block {self.block_size}: {self.num_allocated_slots:,} slots for "
                f"{self.num_effective_tokens:,} tokens, waste {self.waste_per_allocated_slot:.1%} per "
                f"allocated slot, {self.waste_per_effective_token:.1%} per effective token")


def fragmentation(lengths: Mapping[int, int] | Iterable[int], block_size: int) -> Fragmentation:
    """Fragmentation of a length histogram ({length: count}) or a list of request lengths."""
    if block_size <= 0:
        raise InvalidArgument(f"block_size must be positive, got {block_size}")
    histogram = lengths.items() if isinstance(lengths, Mapping) else ((length, 1) for length in lengths)
    num_requests = num_tokens = num_allocated = 0
    for length, count in histogram:
        if length <= 0 or count < 0:
            raise InvalidArgument(f"request lengths must be positive and counts >= 0, got {length}: {count}")
        num_requests += count
        num_tokens += length * count
        num_allocated += num_slots(length, block_size) * count
    return Fragmentation(block_size, num_requests, num_tokens, num_allocated)
