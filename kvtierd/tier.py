"""The tiers as a type: `Tier` (T0 device pool, T1 host, T2 SSD, T3 the shared store), the edges
blocks go down (`Edge`), and counts of blocks per tier (`TierCounts`).

`Tier` and `Edge` are str enums whose values are the names the daemon has always spoken — "t0",
"t1_t3" — so a metric label, a JSON field, a CLI choice or a proto string holding one is the same
text as before, and a name read from the wire compares equal to its member (`"t2" == Tier.T2`).

`TierCounts` is the one shape of "so many blocks in each tier" from the index to the wire: a
lookup's hits, an Acquire's hits and loads, the hit counters. Along a chain the tiers come in
order, T0 first: a chain's leading blocks are in T0, the next in T1, and so on. The proto keeps
its per-tier fields; kvtierd/wire/ converts.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterator


class Tier(enum.StrEnum):
    """Top down: T0 is where the runner reads, each tier below is slower and larger."""

    T0 = "t0"  # the device pool
    T1 = "t1"  # host memory
    T2 = "t2"  # SSD slot files
    T3 = "t3"  # the shared store (Redis Cluster / Valkey)

    @property
    def level(self) -> int:
        """0 for T0, 1 for T1, ...: its place top down."""
        return _LEVELS[self]


_LEVELS = {tier: level for level, tier in enumerate(Tier)}
LOWER_TIERS = (Tier.T1, Tier.T2, Tier.T3)  # promotion's segments, in chain order
LOCAL_TIERS = (Tier.T0, Tier.T1, Tier.T2)  # the node's own: what an operator evicts and a tenant holds


class Edge(enum.StrEnum):
    """An edge blocks are copied down (offload), named `<upper>_<lower>`."""

    T0_T1 = "t0_t1"
    T1_T2 = "t1_t2"
    T1_T3 = "t1_t3"
    T2_T3 = "t2_t3"

    @classmethod
    def between(cls, upper: Tier, lower: Tier) -> Edge:
        return cls(f"{upper.value}_{lower.value}")

    @property
    def upper(self) -> Tier:
        return Tier(self.value.split("_")[0])

    @property
    def lower(self) -> Tier:
        return Tier(self.value.split("_")[1])


@dataclasses.dataclass(frozen=True, slots=True)
class TierCounts:
    """Blocks in each tier. For a chain: its leading blocks found (or loaded) tier by tier, in
    chain order (T0's first). A value: `+` adds tier by tier; iterating gives the counts top down,
    so it unpacks as `t0, t1, t2, t3`."""

    t0: int = 0
    t1: int = 0
    t2: int = 0
    t3: int = 0

    @classmethod
    def of(cls, tier: Tier, count: int) -> TierCounts:
        """`count` blocks in `tier`, none elsewhere."""
        return cls(**{tier.value: count})

    @property
    def num_blocks(self) -> int:
        """Over every tier."""
        return self.t0 + self.t1 + self.t2 + self.t3

    @property
    def num_lower_blocks(self) -> int:
        """In the tiers below T0 (an Acquire's: the blocks being loaded into T0)."""
        return self.t1 + self.t2 + self.t3

    def __getitem__(self, tier: Tier | str) -> int:
        """The count of `tier` (a member, or its name: "t2")."""
        return getattr(self, Tier(tier).value)

    def __iter__(self) -> Iterator[int]:
        return iter((self.t0, self.t1, self.t2, self.t3))

    def items(self) -> tuple[tuple[Tier, int], ...]:
        """(tier, count) top down."""
        return tuple(zip(Tier, self))

    def replace(self, tier: Tier, count: int) -> TierCounts:
        """These counts with `tier`'s set to `count`."""
        return dataclasses.replace(self, **{tier.value: count})

    def first(self, num_blocks: int) -> TierCounts:
        """A chain's counts cut to its first `num_blocks` blocks (>= 0): the top tiers' come first."""
        counts, left = [], num_blocks
        for count in self:
            counts.append(min(count, max(left, 0)))
            left -= counts[-1]
        return TierCounts(*counts)

    def __add__(self, other: TierCounts) -> TierCounts:
        if not isinstance(other, TierCounts):
            return NotImplemented
        return TierCounts(self.t0 + other.t0, self.t1 + other.t1, self.t2 + other.t2, self.t3 + other.t3)

    def __sub__(self, other: TierCounts) -> TierCounts:
        """Tier by tier; `other` is a part of these counts (no tier goes below 0)."""
        if not isinstance(other, TierCounts):
            return NotImplemented
        assert all(a >= b for a, b in zip(self, other)), (self, other)
        return TierCounts(self.t0 - other.t0, self.t1 - other.t1, self.t2 - other.t2, self.t3 - other.t3)

    def __radd__(self, other: int) -> TierCounts:
        """`sum(counts)` starts from 0."""
        if other == 0:
            return self
        return NotImplemented


class AcquiredTierFields:
    """An Acquire's `tier_blocks` by the AcquireResponse's field names, for the classes that carry
    one (the daemon's AcquiredBlocks, the client's AcquireResult)."""

    __slots__ = ()
    tier_blocks: TierCounts

    @property
    def num_t0_hit_blocks(self) -> int:
        return self.tier_blocks.t0

    @property
    def num_t1_blocks(self) -> int:
        return self.tier_blocks.t1

    @property
    def num_t2_blocks(self) -> int:
        return self.tier_blocks.t2

    @property
    def num_t3_blocks(self) -> int:
        return self.tier_blocks.t3
