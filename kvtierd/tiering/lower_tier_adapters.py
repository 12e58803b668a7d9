"""T1, T2 and T3 behind the LowerTier interface (lower_tier.py): each adapter finds a chain's
leading blocks in its tier, claims them for a load, reads them into host rows, and (T2, T3)
takes blocks offered from above. `lower_tiers(tiers, reads)` gives the tiers present, in chain
order (T1, T2, T3): the order of a promotion's segments.

Each tier's path into T0 (`load_path`, weighed against recompute by load_decision.py):
T1 host → device on its slots' bytes; T2 SSD read on its slots' bytes, then host → device on the
blocks' bytes; T3 the store's measured reads on its values' bytes, then host → device likewise.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvtierd.index.slot_entry import SlotEntry, chain_metas
from kvtierd.movers.block_codec import BlockCodec
from kvtierd.movers.copy_engine import Bandwidth, Direction, Transfer
from kvtierd.t1.host_tier import HostTier
from kvtierd.tier import Edge, Tier
from kvtierd.tiering.layout_tiers import Tiers
from kvtierd.tiering.load_decision import Hop
from kvtierd.tiering.lower_reads import LowerReads
from kvtierd.tiering.lower_tier import ChainRest, LowerTier, Rows, Segment

if TYPE_CHECKING:  # built where a tier is (tier_manager.py): lmdb and redis load only when used
    from kvtierd.t2.ssd_tier import SsdTier
    from kvtierd.t3.remote_tier import RemoteTier

log = logging.getLogger(__name__)


class HostLevel:
    """T1: claims pin their entries (SlotIndex.prepare_load) until released; reads nothing, the
    upload decodes from its slots."""

    tier = Tier.T1
    local = True

    def __init__(self, tiers: Tiers, host: HostTier) -> None:
        self.tiers, self.host = tiers, host

    def find(self, chain: ChainRest, count_misses: bool = False) -> int:
        return self.host.index.lookup(*chain)

    def load_path(self, num_blocks: int) -> list[Hop]:
        return [(self.tiers.engine.bandwidth[Direction.HOST_TO_DEVICE], num_blocks * self.host.codec.slot_nbytes)]

    def claim(self, chain: ChainRest, num_present: int | None = None, count_misses: bool = False) -> Segment:
        entries = self.host.index.prepare_load(*chain)
        return Segment(self.tier, [e.meta for e in entries], pinned=entries)

    def read(self, segment: Segment) -> None:
        segment.source = (self.host.slots, [e.slot for e in segment.pinned], self.host.codec)
        return None

    def release(self, segment: Segment) -> None:
        if segment.pinned:
            self.host.index.unpin(segment.pinned)


class SsdLevel:
    """T2: the SSD tier pins its entries during its own read (SsdTier.load), which lands in T1;
    offers are written at once (the caller's thread waits on the disk)."""

    tier = Tier.T2
    local = True
    offer_waits = True

    def __init__(self, tiers: Tiers, ssd: SsdTier, codec: BlockCodec, reads: LowerReads) -> None:
        self.tiers, self.ssd, self.codec, self.reads = tiers, ssd, codec, reads

    def find(self, chain: ChainRest, count_misses: bool = False) -> int:
        return self.ssd.lookup(*chain)

    def load_path(self, num_blocks: int) -> list[Hop]:
        return _read_then_upload(self.tiers, num_blocks, self.tiers.ssd_read, self.codec)

    def claim(self, chain: ChainRest, num_present: int | None = None, count_misses: bool = False) -> Segment:
        num_hits = self.ssd.lookup(*chain)
        return Segment(self.tier, self.ssd.metas(chain.block_hashes[:num_hits]))

    def read(self, segment: Segment) -> Transfer:
        nbytes = len(segment.metas) * self.codec.slot_nbytes
        return self.tiers.submit(Direction.HOST_TO_HOST, lambda: self.reads.read_t2(segment), nbytes)

    def release(self, segment: Segment) -> None:
        pass

    def offer(self, entries: Sequence[SlotEntry], rows: Rows, edge: Edge) -> int:
        """Write the blocks not already here, straight from `rows` (T1's slots are 4 KiB aligned: an
        O_DIRECT write takes them as they are, no copy); blocking. Those T2 then lacks (no slot free
        of loads and stores, not admitting, the tenant's quota, a failed write) count as dropped."""
        tiers = self.tiers
        try:
            with tiers.ssd_write.measure(len(entries) * self.codec.slot_nbytes):
                num_stored = self.ssd.store([(e.meta, rows[i]) for i, e in enumerate(entries)])
        except Exception:  # the SSD tier reports its own errors; the host tier keeps serving
            log.exception("writing %d blocks to the SSD tier failed", len(entries))
            tiers.counters.count_failed_offloads(len(entries))
            return 0
        tiers.counters.count_offloaded(edge, num_stored)
        num_refused = sum(1 for e in entries if not self.ssd.holds(e.block_hash))
        tiers.counters.count_dropped_offloads(edge, num_refused)
        if num_refused and self.ssd.admitting:  # a T2 that stopped admitting said so once, with its reason
            log.warning("T2 did not take %d of %d blocks offered down %s: no slot free of loads and stores, or the "
                        "tenant's quota", num_refused, len(entries), edge)
        return num_stored


class RemoteLevel:
    """T3: `find` probes the chain's first and last keys (t3/chain_probe.py); a claim reuses the
    answer of a Lookup of the same chain (probe(..., reuse=True)) or the one it is given; reads run
    on the store's reader threads, verify every value, and land in T1; offers are framed (copied)
    and queued for the store's writer, never waited for."""

    tier = Tier.T3
    local = False
    offer_waits = False

    def __init__(self, tiers: Tiers, remote: RemoteTier, codec: BlockCodec, reads: LowerReads) -> None:
        self.tiers, self.remote, self.codec, self.reads = tiers, remote, codec, reads

    def find(self, chain: ChainRest, count_misses: bool = False) -> int:
        return self.remote.probe(chain.block_hashes, count_misses)

    def load_path(self, num_blocks: int) -> list[Hop]:
        return _read_then_upload(self.tiers, num_blocks, self.remote.read, self.codec)

    def claim(self, chain: ChainRest, num_present: int | None = None, count_misses: bool = False) -> Segment:
        """Candidates: the chain's next blocks the store holds, chained to their parents; token
        ids b"" where the caller sent none. `count_misses`: what the store lacks now are T3 misses
        (a store's Acquire asks for what it is about to write: no miss)."""
        hashes, parent, rest_tokens, block_size = chain
        num_hits = (self.remote.probe(hashes, count_misses, reuse=True) if num_present is None
                    else min(num_present, len(hashes)))
        return Segment(self.tier, chain_metas(hashes, rest_tokens, 0, num_hits, parent, block_size))

    def read(self, segment: Segment) -> Transfer:
        nbytes = len(segment.metas) * self.codec.slot_nbytes
        return self.tiers.submit_remote_read(lambda: self.reads.read_t3(segment), nbytes)

    def release(self, segment: Segment) -> None:
        pass

    def offer(self, entries: Sequence[SlotEntry], rows: Rows, edge: Edge) -> int:
        counters = self.tiers.counters
        try:
            num_queued = self.remote.offer([e.meta for e in entries], rows)
        except Exception:
            log.exception("framing %d blocks for the T3 store failed", len(entries))
            counters.count_failed_offloads(len(entries))
            return 0
        counters.count_offloaded(edge, num_queued)
        return num_queued


def _read_then_upload(tiers: Tiers, num_blocks: int, read: Bandwidth, codec: BlockCodec) -> list[Hop]:
    """A load from below T1: the blocks read at `read` (in `codec`'s bytes), then uploaded host → device."""
    return [(read, num_blocks * codec.slot_nbytes),
            (tiers.engine.bandwidth[Direction.HOST_TO_DEVICE], num_blocks * tiers.layout.bytes_per_block)]


def lower_tiers(tiers: Tiers, reads: LowerReads) -> list[LowerTier]:
    """The tiers below T0 that are configured, in chain order."""
    levels: list[LowerTier] = []
    if tiers.host is not None:
        levels.append(HostLevel(tiers, tiers.host))
    if tiers.ssd is not None:
        assert tiers.ssd_codec is not None  # set with it (Tiers.__post_init__)
        levels.append(SsdLevel(tiers, tiers.ssd, tiers.ssd_codec, reads))
    if tiers.remote is not None:
        assert tiers.remote_codec is not None
        levels.append(RemoteLevel(tiers, tiers.remote, tiers.remote_codec, reads))
    return levels
