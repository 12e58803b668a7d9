"""Promotion: prefix hits in T1, T2 and T3 copied up into freshly allocated T0 blocks.

`acquire` allocates the request's blocks in T0 (T0 hits first), then continues the hash chain
in T1, after that in T2, then in T3 (the shared store: asking it is a network round trip, so
with T3 the daemon calls `acquire` and `lookup` off its loop). Each lower-tier segment is
loaded only if its copy is expected to be faster than recomputing its tokens
(tier_config.worth_loading). Loads run in the background, submitted from a mover thread once
the targets' evicted bytes have landed (write_backs.py);
the caller gets a Ticket whose result is how many leading blocks are ready in T0: it computes
the rest. Protection while in flight: the T0 targets are held by the request itself, T1 entries
are pinned (prepare_load), T2 entries are pinned by the SSD tier during its read, T3 values
are the store's (a key it dropped meanwhile is a miss). Promoted
blocks are committed in T0 only when every segment before them landed, so a failed transfer is
a miss — the runner recomputes into blocks that are still its own — and never a hit.
T2 and T3 hits also land in T1 on their way up (inclusive tiers, lower_reads.py). `prefetch`
runs that step into T1 ahead of use, while a request still queues.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import threading

from kvtierd.block_hash import pack_token_ids
from kvtierd.errors import KvtierError
from kvtierd.index.query_counting import QueryCounting
from kvtierd.index.slot_entry import BlockMeta, SlotEntry
from kvtierd.movers.copy_engine import Direction
from kvtierd.tiering.lower_reads import LowerReads, Segment
from kvtierd.tiering.offload import Offloader
from kvtierd.tiering.tier_config import worth_loading
from kvtierd.tiering.tiers import Tiers

log = logging.getLogger(__name__)
_FROM_CONFIG = object()


class Ticket:
    """Resolves to the number of leading blocks of the request that are ready in T0, once every
    block of the request may be written (evicted bytes copied down, loads landed)."""

    def __init__(self, num_ready_blocks: int | None = None) -> None:
        self.future: concurrent.futures.Future[int] = concurrent.futures.Future()
        if num_ready_blocks is not None:
            self.future.set_result(num_ready_blocks)

    def wait(self, timeout_s: float | None = None) -> int:
        return self.future.result(timeout_s)

    def done(self) -> bool:
        return self.future.done()


@dataclasses.dataclass(frozen=True)
class AcquiredBlocks:
    block_ids: list[int]
    num_t0_hit_blocks: int
    num_t1_blocks: int  # being loaded from the host tier
    num_t2_blocks: int  # being loaded from the SSD tier
    num_t3_blocks: int  # being loaded from the shared store (present when asked; the ticket says what landed)
    ticket: Ticket
    # resolves once every block may be written (evicted contents copied down); None: at once
    writable: concurrent.futures.Future[None] | None = None


@dataclasses.dataclass(frozen=True)
class TierHits:
    """Leading blocks of a chain found in each tier, in chain order (t0 first)."""

    t0: int
    t1: int
    t2: int
    t3: int = 0

    @property
    def num_blocks(self) -> int:
        return self.t0 + self.t1 + self.t2 + self.t3


class Promoter:
    def __init__(self, tiers: Tiers, offloader: Offloader) -> None:
        self.tiers = tiers
        self.offloader = offloader  # reserves T1 slots (spilling T1's victims to T2 by policy)
        self.reads = LowerReads(tiers, offloader)
        self._pending: dict[object, Ticket] = {}
        self._lock = threading.Lock()

    # ----------------------------------------------------------------------------- queries

    def lookup(self, block_hashes: list[bytes], token_ids=None, ask_remote: bool = True,
               count_misses: bool = False) -> TierHits:
        """Where the chain's prefix lives, tier by tier (T3: the keys present; a network round
        trip, skipped when the local tiers hold the whole chain or `ask_remote` is False).
        Changes nothing, but for T3's misses when `count_misses` (the caller's chain is a query:
        t3/remote_tier.py)."""
        tiers = self.tiers
        token_bytes = pack_token_ids(token_ids) if token_ids is not None else None
        n0 = tiers.index.lookup(block_hashes, token_bytes)
        n1 = n2 = n3 = 0
        if tiers.host is not None:
            n1 = tiers.host.index.lookup(*self._rest(block_hashes, token_bytes, n0))
        if tiers.ssd is not None:
            n2 = tiers.ssd.lookup(*self._rest(block_hashes, token_bytes, n0 + n1))
        if tiers.remote is not None and ask_remote:
            n3 = tiers.remote.probe(block_hashes[n0 + n1 + n2:], count_misses)
        return TierHits(n0, n1, n2, n3)

    def pending(self, request_id: object) -> Ticket | None:
        with self._lock:
            return self._pending.get(request_id)

    # ----------------------------------------------------------------------------- acquire

    def acquire(self, request_id, block_hashes: list[bytes], num_extra_blocks: int = 0, token_ids=None,
                recompute_s_per_token=_FROM_CONFIG, num_t3_present: int | None = None,
                counting: QueryCounting = QueryCounting.QUERY_AND_HITS) -> AcquiredBlocks:
        """`num_t3_present`: how many of the chain's blocks after the local hits the shared store
        holds, when a lookup just asked (None: ask it). `counting`: whether its chain enters the
        query count and the blocks it finds the hit counts (query_counting.py)."""
        tiers = self.tiers
        cost = tiers.config.recompute_s_per_token if recompute_s_per_token is _FROM_CONFIG else recompute_s_per_token
        token_bytes = pack_token_ids(token_ids) if token_ids is not None else None
        allocation = tiers.index.allocate(request_id, block_hashes, num_extra_blocks, token_bytes, counting=counting)
        n0 = allocation.num_hit_blocks
        t1_entries = self._t1_hits(block_hashes, token_bytes, n0, cost)
        t2_metas = self._t2_hits(block_hashes, token_bytes, n0 + len(t1_entries), cost)
        t3_metas = self._t3_hits(block_hashes, token_bytes, n0 + len(t1_entries) + len(t2_metas), cost,
                                 num_t3_present, count_misses=counting.counts_hits)
        if counting.counts_hits:
            tiers.counters.add("num_hit_blocks", n0, "t0")
        if counting.counts_query:
            tiers.counters.add("num_query_blocks", len(block_hashes))
        writable = tiers.write_backs.when_landed(allocation.block_ids[n0:])
        if not t1_entries and not t2_metas and not t3_metas:
            return AcquiredBlocks(allocation.block_ids, n0, 0, 0, 0,
                                  self._ticket_when_writable(allocation.block_ids, n0), writable)
        ticket = Ticket()
        with self._lock:
            self._pending[request_id] = ticket
        targets = allocation.block_ids[n0:]
        segments = [Segment("t1", [e.meta for e in t1_entries]), Segment("t2", t2_metas), Segment("t3", t3_metas)]
        # An empty segment is settled before any load starts: a load can finish (and call `done`,
        # on the finalizer thread) before this thread reaches its next line, and `_finish` resolves
        # the ticket only once every segment is settled.
        for segment in segments:
            if not segment.metas:
                segment.num_loaded = 0
        done = lambda: self._finish(request_id, n0, targets, segments, ticket, counting)  # noqa: E731

        def start_loads() -> None:  # on a mover thread: submit may wait for the engine's budget
            if t1_entries:
                self._start(functools.partial(self._load_t1, t1_entries), targets[:len(t1_entries)], segments[0],
                            done)
            lower = len(t1_entries)
            for segment, read in ((segments[1], self.reads.read_t2), (segments[2], self.reads.read_t3)):
                if segment.metas:
                    self._start(functools.partial(self._load_lower, read), targets[lower:lower + len(segment.metas)],
                                segment, done)
                lower += len(segment.metas)

        self.after_writable(targets, start_loads)
        return AcquiredBlocks(allocation.block_ids, n0, len(t1_entries), len(t2_metas), len(t3_metas), ticket,
                              writable)

    def _ticket_when_writable(self, block_ids: list[int], num_ready_blocks: int) -> Ticket:
        """A ticket that resolves once the blocks may be written (at once, usually)."""
        landed = self.tiers.write_backs.when_landed(block_ids)
        if landed is None:
            return Ticket(num_ready_blocks)
        ticket = Ticket()
        landed.add_done_callback(lambda _: ticket.future.set_result(num_ready_blocks))
        return ticket

    def after_writable(self, block_ids: list[int], work) -> None:
        """Dispatch `work` to a mover thread once no write-back is in flight from `block_ids`."""
        tiers = self.tiers
        landed = tiers.write_backs.when_landed(block_ids)
        if landed is None:
            tiers.dispatch(work)
        else:
            landed.add_done_callback(lambda _: tiers.dispatch(work))

    def prefetch(self, block_hashes: list[bytes], token_ids=None, hits: TierHits | None = None) -> int:
        """Start copying the chain's T2 and T3 segments into T1; returns how many blocks that is."""
        tiers = self.tiers
        if tiers.host is None or (tiers.ssd is None and tiers.remote is None):
            return 0
        token_bytes = pack_token_ids(token_ids) if token_ids is not None else None
        hits = hits or self.lookup(block_hashes, token_bytes)
        start = hits.t0 + hits.t1
        t2_metas = self._t2_hits(block_hashes, token_bytes, start, None)
        t3_metas = self._t3_hits(block_hashes, token_bytes, start + len(t2_metas), None, hits.t3)
        for tier, metas, read in (("t2", t2_metas, self.reads.read_t2), ("t3", t3_metas, self.reads.read_t3)):
            if metas:
                segment = Segment(tier, metas)
                tiers.dispatch(lambda read=read, segment=segment: self._submit_read(read, segment))
        return len(t2_metas) + len(t3_metas)

    # ----------------------------------------------------------------------------- planning

    def _rest(self, block_hashes, token_bytes, start: int):
        """(hashes, parent, token bytes, block size) of the chain from block `start` on."""
        stride = 4 * self.tiers.layout.block_size
        parent = block_hashes[start - 1] if start else self.tiers.index.root
        return (block_hashes[start:], parent, token_bytes[start * stride:] if token_bytes is not None else None,
                self.tiers.layout.block_size)

    def _t1_hits(self, block_hashes, token_bytes, start: int, cost) -> list[SlotEntry]:
        tiers = self.tiers
        if tiers.host is None or start == len(block_hashes):
            return []
        entries = tiers.host.index.prepare_load(*self._rest(block_hashes, token_bytes, start))
        nbytes = len(entries) * tiers.host.codec.slot_nbytes
        if entries and not worth_loading(len(entries) * tiers.layout.block_size,
                                         [(tiers.engine.bandwidth[Direction.HOST_TO_DEVICE], nbytes)], cost):
            tiers.host.index.unpin(entries)
            tiers.counters.add("num_skipped_slow_blocks", len(entries))
            return []
        return entries

    def _t2_hits(self, block_hashes, token_bytes, start: int, cost) -> list[BlockMeta]:
        tiers = self.tiers
        if tiers.ssd is None or start == len(block_hashes):
            return []
        rest = self._rest(block_hashes, token_bytes, start)
        num_hits = tiers.ssd.lookup(*rest)
        path = [(tiers.ssd_read, num_hits * tiers.ssd_codec.slot_nbytes),
                (tiers.engine.bandwidth[Direction.HOST_TO_DEVICE], num_hits * tiers.layout.bytes_per_block)]
        if num_hits and not worth_loading(num_hits * tiers.layout.block_size, path, cost):
            tiers.counters.add("num_skipped_slow_blocks", num_hits)
            return []
        return tiers.ssd.metas(rest[0][:num_hits])

    def _t3_hits(self, block_hashes, token_bytes, start: int, cost, num_present: int | None = None,
                 count_misses: bool = False) -> list[BlockMeta]:
        """Candidates for a T3 load: the chain's next blocks the store holds (`num_present`, or the
        answer of a Lookup of this chain just before, or asked now), chained to their parents;
        token ids b"" where the caller sent none. `count_misses`: the chain is a query, so what the
        store lacks now are T3 misses (a store's Acquire asks for what it is about to write: no miss)."""
        tiers = self.tiers
        if tiers.remote is None or start == len(block_hashes):
            return []
        hashes, parent, rest_tokens, block_size = self._rest(block_hashes, token_bytes, start)
        num_hits = (tiers.remote.probe(hashes, count_misses, reuse=True) if num_present is None
                    else min(num_present, len(hashes)))
        path = [(tiers.remote.read, num_hits * tiers.remote_codec.slot_nbytes),
                (tiers.engine.bandwidth[Direction.HOST_TO_DEVICE], num_hits * tiers.layout.bytes_per_block)]
        if num_hits and not worth_loading(num_hits * block_size, path, cost):
            tiers.counters.add("num_skipped_slow_blocks", num_hits)
            return []
        stride = 4 * block_size
        parents = [parent, *hashes[:num_hits - 1]]
        return [BlockMeta(h, p, rest_tokens[i * stride:(i + 1) * stride] if rest_tokens is not None else b"")
                for i, (h, p) in enumerate(zip(hashes[:num_hits], parents))]

    # ----------------------------------------------------------------------------- loading

    def _start(self, load, targets: list[int], segment: Segment, done) -> None:
        """Start one segment's load (`load(targets, segment, done)`); one that cannot start is a
        miss, settled on the finalizer thread."""
        try:
            load(targets, segment, done)
        except Exception:
            log.exception("starting a load of %d blocks failed", len(targets))

            def settle() -> None:
                if segment.num_loaded is None:
                    segment.num_loaded = 0
                    done()

            self.tiers.finalizer.submit(settle)

    def _load_t1(self, entries: list[SlotEntry], targets: list[int], segment: Segment, done) -> None:
        tiers = self.tiers
        slot_ids = [e.slot for e in entries]
        job = lambda: tiers.host.codec.decode(tiers.host.slots, slot_ids, tiers.pool.tensor, targets)  # noqa: E731
        try:
            transfer = tiers.submit(Direction.HOST_TO_DEVICE, job, len(entries) * tiers.host.codec.slot_nbytes)
        except BaseException:
            tiers.host.index.unpin(entries)
            raise

        def finalize(error: BaseException | None) -> None:
            tiers.host.index.unpin(entries)
            segment.num_loaded = 0 if error is not None else len(entries)
            done()

        tiers.after(transfer, finalize)

    def _submit_read(self, read, segment: Segment):
        """Start `read(segment)`, T2 → host on a copy engine host thread or T3 → host on the shared
        store's reader threads (landing in T1 too); its Transfer."""
        tiers = self.tiers
        if segment.tier == "t3":
            nbytes = len(segment.metas) * tiers.remote_codec.slot_nbytes
            return tiers.submit_remote_read(lambda: read(segment), nbytes)
        nbytes = len(segment.metas) * tiers.ssd_codec.slot_nbytes
        return tiers.submit(Direction.HOST_TO_HOST, lambda: read(segment), nbytes)

    def _load_lower(self, read, targets: list[int], segment: Segment, done) -> None:
        """T2 or T3 → host (landing in T1 too), then host → T0 on the load stream."""
        tiers = self.tiers
        read_transfer = self._submit_read(read, segment)

        def after_read(error: BaseException | None) -> None:
            if error is not None or not segment.source[1]:  # source is set when the read returned
                segment.num_loaded = 0
                done()
                return
            rows, ids, source_codec = segment.source
            job = lambda: source_codec.decode(rows, ids, tiers.pool.tensor, targets[:len(ids)])  # noqa: E731
            upload = tiers.submit(Direction.HOST_TO_DEVICE, job, len(ids) * source_codec.slot_nbytes)

            def after_upload(upload_error: BaseException | None) -> None:
                segment.num_loaded = 0 if upload_error is not None else len(ids)
                done()

            tiers.after(upload, after_upload)

        tiers.after(read_transfer, after_read)

    def _finish(self, request_id, start: int, targets: list[int], segments: list[Segment], ticket: Ticket,
                counting: QueryCounting) -> None:
        """When every segment has landed: commit the contiguous prefix that loaded, resolve."""
        if any(s.num_loaded is None for s in segments):
            return
        tiers = self.tiers
        loaded: list[BlockMeta] = []
        for segment in segments:
            loaded += segment.metas[:segment.num_loaded]
            if segment.num_loaded < len(segment.metas):
                tiers.counters.add("num_failed_load_blocks", len(segment.metas) - segment.num_loaded)
                break
        num_committed = 0
        if loaded:
            try:
                tiers.index.commit_blocks(request_id, start, [m.block_hash for m in loaded],
                                          b"".join(m.token_ids for m in loaded), loaded[0].parent_hash)
                num_committed = len(loaded)
            except KvtierError as e:  # the request went away meanwhile
                log.info("promoted blocks of %r not committed: %s", request_id, e)
        num_uncounted = num_committed if counting.counts_hits else 0
        for segment in segments:  # the committed blocks, tier by tier in chain order
            num_hits = min(num_uncounted, len(segment.metas))
            tiers.counters.add("num_hit_blocks", num_hits, segment.tier)
            num_uncounted -= num_hits
        with self._lock:
            self._pending.pop(request_id, None)
        ticket.future.set_result(start + num_committed)
