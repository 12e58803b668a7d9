"""A Lookup's answer, the same type from the core (TierManager.lookup_chains) through the wire to the
client (Session.lookup): per chain asked, its leading blocks found tier by tier and, of them, the
trailing ones slower to load than to recompute."""

from __future__ import annotations

import dataclasses

from kvtierd.tier import TierCounts


@dataclasses.dataclass(frozen=True)
class ChainLookup:
    """Invariant: one `hits` and one `declined` per chain, in the order asked; each chain's
    `declined` is the tail of its `hits` (at most as many blocks)."""

    hits: tuple[TierCounts, ...]
    declined: tuple[TierCounts, ...]

    def __post_init__(self) -> None:
        assert len(self.hits) == len(self.declined), (len(self.hits), len(self.declined))
        assert all(d.num_blocks <= h.num_blocks for h, d in zip(self.hits, self.declined))

    @property
    def total(self) -> TierCounts:
        """Every chain's hits added tier by tier."""
        return sum(self.hits, TierCounts())

    @property
    def num_declined_blocks(self) -> int:
        return sum(d.num_blocks for d in self.declined)

    @property
    def kept(self) -> tuple[TierCounts, ...]:
        """Per chain, the hits an Acquire would load: its leading blocks less the declined tail."""
        return tuple(h.first(h.num_blocks - d.num_blocks) for h, d in zip(self.hits, self.declined))


def declined_tail(hits: TierCounts, num_declined: int) -> TierCounts:
    """The last `num_declined` blocks of a chain's `hits`, tier by tier (the declined are the
    trailing hits, from the lowest tier up)."""
    assert 0 <= num_declined <= hits.num_blocks, (num_declined, hits)
    return hits - hits.first(hits.num_blocks - num_declined)
