"""Capacity planning (`kvtierctl plan`): what a node's tiers hold for a model and a length mix.

From the KV bytes per token (a model's shape, or given), a budget per tier and a distribution of
request lengths: blocks and tokens per tier, and for each block size the fragmentation with both
denominators (waste per effective token, per allocated slot; fragmentation.py) and the
concurrency it leaves: usable bytes / (mean allocated slots per request x bytes per token).
The worked example of seed 003 is the test: 34-token requests, 819,200 B a token, 40 GB at 0.9
utilization: block 16 → 48 slots a request, about 915 at once; block 8 → 40 slots, about 1,098.

Warnings (seed 003, "long contexts get a pool of their own"): a request longer than T0 holds
cannot run; one whose KV exceeds the host tier (T1) would thrash when offloaded; long requests
that each take a large share of T0 crowd short ones out: give long contexts a separate pool.

Budgets are parsed by `units.parse_bytes`, as everywhere: "GB" and "MB" are decimal (80 GB = 80e9 bytes, as GPU
and DIMM sizes are sold), "GiB" and "MiB" binary.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from kvtierd.errors import InvalidArgument
from kvtierd.planning.fragmentation import Fragmentation, fragmentation
from kvtierd.tier import LOCAL_TIERS, Tier
from kvtierd.units import round_up

DEFAULT_BLOCK_SIZES = (8, 16, 32)
LONG_REQUEST_SHARE_OF_T0 = 0.25  # a request taking more of T0 than this crowds short ones out


def parse_histogram(text: str) -> dict[int, int]:
    """`length count` lines ('#' comments) → {length: count}."""
    histogram: dict[int, int] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.replace(",", " ").split()
        try:
            length, count = (int(parts[0]), int(parts[1]) if len(parts) > 1 else 1)
        except (ValueError, IndexError):
            raise InvalidArgument(f"histogram line {number}: expected 'length count', got {line!r}") from None
        if length <= 0 or count < 0 or len(parts) > 2:
            raise InvalidArgument(f"histogram line {number}: need a positive length and a count >= 0, got {line!r}")
        histogram[length] = histogram.get(length, 0) + count
    if not sum(histogram.values()):
        raise InvalidArgument("the length histogram is empty")
    return histogram


def histogram_from_percentiles(percentiles: Mapping[int, int]) -> dict[int, int]:
    """A step distribution from percentile points {50: 200, 90: 1500, 99: 6000}: the requests
    between two points are counted at the upper one (a conservative rounding up); 100 requests."""
    if not percentiles:
        raise InvalidArgument("give at least one percentile")
    histogram: dict[int, int] = {}
    previous = 0
    for p, length in sorted(percentiles.items()):
        if not 0 < p <= 100 or length <= 0:
            raise InvalidArgument(f"percentiles are in (0, 100] with positive lengths, got p{p}={length}")
        histogram[length] = histogram.get(length, 0) + (p - previous)
        previous = p
    if previous < 100:  # the tail above the last point, at that point's length
        last = percentiles[max(percentiles)]
        histogram[last] += 100 - previous
    return histogram


@dataclasses.dataclass(frozen=True, slots=True)
class BlockSizePlan:
    block_size: int
    fragmentation: Fragmentation
    slots_per_request: float  # mean allocated slots
    max_concurrency: float  # of T0: requests of the mix at once
    max_concurrency_at_longest: float


@dataclasses.dataclass(frozen=True, slots=True)
class TierPlan:
    tier: Tier
    budget_bytes: int
    usable_bytes: int
    num_tokens: int  # at block granularity of the first block size


@dataclasses.dataclass(frozen=True, slots=True)
class CapacityPlan:
    bytes_per_token: int
    tiers: list[TierPlan]
    block_sizes: list[BlockSizePlan]
    longest_request: int
    mean_request: float
    warnings: list[str]


def plan(bytes_per_token: int, budgets: Mapping[Tier, int], lengths: Mapping[int, int], utilization: float = 1.0,
         block_sizes: Sequence[int] = DEFAULT_BLOCK_SIZES) -> CapacityPlan:
    """`budgets` by tier (T0 required; T1, T2 optional); `utilization` of T0 is usable."""
    if bytes_per_token <= 0:
        raise InvalidArgument(f"KV bytes per token must be positive, got {bytes_per_token}")
    if not 0 < utilization <= 1:
        raise InvalidArgument(f"utilization must be in (0, 1], got {utilization}")
    if Tier.T0 not in budgets:
        raise InvalidArgument("a plan needs the T0 (device) budget")
    usable = {tier: int(budget * (utilization if tier == Tier.T0 else 1.0)) for tier, budget in budgets.items()}
    tiers = [TierPlan(tier, budgets[tier], usable[tier], usable[tier] // bytes_per_token)
             for tier in LOCAL_TIERS if tier in budgets]
    longest = max(lengths)
    rows = []
    for block_size in block_sizes:
        frag = fragmentation(lengths, block_size)
        slots = frag.num_allocated_slots / frag.num_requests
        longest_slots = round_up(longest, block_size)
        rows.append(BlockSizePlan(block_size, frag, slots, usable[Tier.T0] / (slots * bytes_per_token),
                                  usable[Tier.T0] / (longest_slots * bytes_per_token)))
    total = fragmentation(lengths, 1)
    return CapacityPlan(bytes_per_token, tiers, rows, longest, total.num_effective_tokens / total.num_requests,
                        _warnings(bytes_per_token, usable, longest))


def _warnings(bytes_per_token: int, usable: Mapping[Tier, int], longest: int) -> list[str]:
    need = longest * bytes_per_token
    warnings = []
    if need > usable[Tier.T0]:
        warnings.append(f"a {longest:,}-token request needs {need / 1e9:,.2f} GB of KV, more than T0's usable "
                        f"{usable[Tier.T0] / 1e9:,.2f} GB: it cannot run on this pool at all")
    elif need > LONG_REQUEST_SHARE_OF_T0 * usable[Tier.T0]:
        warnings.append(f"one {longest:,}-token request takes {need / usable[Tier.T0]:.0%} of T0: long requests "
                        f"crowd short ones out (they queue or are preempted); serve long contexts from a "
                        f"separate long-context pool")
    if Tier.T1 in usable and need > usable[Tier.T1]:
        warnings.append(f"a {longest:,}-token request's KV ({need / 1e9:,.2f} GB) exceeds the host tier "
                        f"({usable[Tier.T1] / 1e9:,.2f} GB): offloading it would thrash T1 (every block evicts one "
                        f"of its own); give long contexts a separate long-context pool, or a larger T1")
    return warnings


def plan_lines(result: CapacityPlan) -> list[str]:
    bpt = result.bytes_per_token
    lines = [f"KV bytes per token: {bpt:,} ({bpt / 1024:,.1f} KiB)",
             f"requests: mean {result.mean_request:,.1f} tokens, longest {result.longest_request:,}", ""]
    lines.append(f"{'tier':<5} {'budget':>12} {'usable':>12} {'tokens':>14}")
    for tier in result.tiers:
        lines.append(f"{tier.tier:<5} {tier.budget_bytes / 1e9:>9,.2f} GB {tier.usable_bytes / 1e9:>9,.2f} GB "
                     f"{tier.num_tokens:>14,}")
    lines += ["", f"{'block':>5} {'slots/req':>9} {'waste/effective token':>21} {'waste/allocated slot':>20} "
                  f"{'concurrency (mix)':>17} {'at longest':>10}"]
    for row in result.block_sizes:
        lines.append(f"{row.block_size:>5} {row.slots_per_request:>9,.1f} "
                     f"{row.fragmentation.waste_per_effective_token:>21.1%} "
                     f"{row.fragmentation.waste_per_allocated_slot:>20.1%} {row.max_concurrency:>17,.1f} "
                     f"{row.max_concurrency_at_longest:>10,.1f}")
    lines.append("(waste per effective token and per allocated slot are two denominators: never subtract or "
                 "swap them)")
    lines += [f"warning: {w}" for w in result.warnings]
    return lines
