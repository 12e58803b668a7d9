"""The tiers below T0 as one interface: what promotion (promotion.py) and offload (offload.py) ask
of T1, T2 and T3, so that both loop over the tiers in chain order instead of naming each.

A lower tier (`LowerTier`; the adapters are in lower_tier_adapters.py):
- `find`: how many leading blocks of a chain it holds (a Lookup; changes nothing, but for T3's
  misses when the chain is a query);
- `load_path`: the hops a load of so many of its blocks takes into T0, each with its bandwidth
  estimate and bytes, which promotion weighs against recomputing them (load_decision.py);
- `claim`: the leading blocks of a chain to load from it, protected until `release` (T1 pins its
  entries; T2 pins during its own read; T3's values are the store's);
- `read`: the claimed blocks into host rows (T2 and T3: read from below, landing in T1 on the way,
  lower_reads.py; T1: its slots are host rows already), which the load into T0 decodes from.
A tier that takes blocks from an upper one (`StoringTier`: T2 and T3) also has
- `offer`: store (T2: a disk write) or queue (T3: framed for the store's writer) blocks given as
  host rows, counting them under the edge they came down.
T1 takes no offer: every store into it is two-phase around a copy whose bytes do not exist yet
(a T0 block copied down, offload.py; a block read from below, lower_reads.py): its slots are
reserved first (Offloader.prepare_t1_store) and the copy lands in them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple, Protocol, runtime_checkable

import torch

from kvtierd.daemon_key import DaemonKey
from kvtierd.index.slot_entry import BlockMeta, SlotEntry
from kvtierd.movers.block_codec import BlockCodec
from kvtierd.movers.copy_engine import Transfer
from kvtierd.tier import Edge, Tier
from kvtierd.tiering.load_decision import Hop
from kvtierd.token_bytes import TokenBytes

# Blocks' bytes in one codec, one row per block: a uint8 tensor, or one 1-D uint8 view each (of T1 slots).
Rows = torch.Tensor | list[torch.Tensor]


class ChainRest(NamedTuple):
    """A chain from one of its blocks on, as the tiers' indexes take it (`lookup(*rest)`)."""

    block_hashes: list[DaemonKey]
    parent: DaemonKey | None  # the first block's parent (the root for block 0)
    token_bytes: TokenBytes | None  # the blocks' token ids (None: the caller sent none)
    block_size: int


@dataclasses.dataclass
class Segment:
    """One tier's part of a promotion; touched only on the finalizer thread once in flight."""

    tier: Tier
    metas: list[BlockMeta]  # T3: candidates until read (token ids b"" when the caller sent none)
    num_loaded: int | None = None  # None while in flight
    source: tuple | None = None  # once read: (rows, row ids, codec) the upload into T0 decodes from
    pinned: list[SlotEntry] = dataclasses.field(default_factory=list)  # T1: its entries, pinned until released


class LowerTier(Protocol):
    tier: Tier
    local: bool  # False: asking it is a network round trip (T3), which the daemon makes off its loop

    def find(self, chain: ChainRest, count_misses: bool = False) -> int:
        """How many leading blocks of `chain` it holds. `count_misses`: the chain is a query, so
        what it lacks are its misses (T3 counts them; the local tiers count no misses)."""
        ...

    def load_path(self, num_blocks: int) -> list[Hop]:
        """The hops of loading `num_blocks` of its blocks into T0, in order: each hop's bandwidth
        estimate and the bytes that cross it."""
        ...

    def claim(self, chain: ChainRest, num_present: int | None = None, count_misses: bool = False) -> Segment:
        """The leading blocks of `chain` to load from here, protected until `release`.
        `num_present`: what a Lookup of this chain just found here; a tier asked over the network
        (T3) takes it instead of asking again (a stale answer is a miss at load), the local tiers
        look again (cheap; T1 pins what it claims)."""
        ...

    def read(self, segment: Segment) -> Transfer | None:
        """Start reading the claimed blocks into host rows, landing in T1 on the way; the read
        sets `segment.source` (its leading blocks that came). None: they are host rows already
        (T1's slots), `source` is set now."""
        ...

    def release(self, segment: Segment) -> None:
        """Once the segment's load into T0 finished or failed: drop the protection of `claim`."""
        ...


@runtime_checkable
class StoringTier(LowerTier, Protocol):
    codec: BlockCodec  # how its slots (T2) or values (T3) hold a block
    offer_waits: bool  # True: an offer waits on storage (T2's disk); False: it only queues (T3)

    def offer(self, entries: Sequence[SlotEntry], rows: Rows, edge: Edge) -> int:
        """Store (or queue) the entries' blocks, `rows` in this tier's codec (a uint8 tensor of
        one row per block, or one 1-D view per block, read before returning); how many it took,
        counted under `edge`. Never raises for the storage's failures: they are counted."""
        ...
