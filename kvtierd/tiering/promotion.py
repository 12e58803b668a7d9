"""Promotion: prefix hits in T1, T2 and T3 copied up into freshly allocated T0 blocks.

`acquire` allocates the request's blocks in T0 (T0 hits first), then continues the hash chain
in T1, after that in T2, then in T3 (the shared store: asking it is a network round trip, so
with T3 the daemon calls `acquire` and `lookup` off its loop). A lower-tier segment is loaded
only if its copy is expected to be faster than recomputing its tokens, and none after the first
that is not (load_decision.py; `declined` answers the same for a Lookup's hits, and a prefetch
reads only what would be loaded). Loads run in the background, submitted from a mover thread once
the targets' evicted bytes have landed (write_backs.py);
the caller gets a Ticket whose result is how many leading blocks are ready in T0: it computes
the rest. Protection while in flight: the T0 targets are held by the request itself, T1 entries
are pinned (prepare_load), T2 entries are pinned by the SSD tier during its read, T3 values
are the store's (a key it dropped meanwhile is a miss). Promoted
blocks are committed in T0 only when every segment before them landed, so a failed transfer is
a miss — the runner recomputes into blocks that are still its own — and never a hit.
T2 and T3 hits also land in T1 on their way up (inclusive tiers, lower_reads.py). `prefetch`
runs that step into T1 ahead of use, while a request still queues.
Each step loops over the lower tiers present, in chain order, through one interface
(lower_tier.py; the adapters, with each tier's protection and cost check, in lower_tier_adapters.py).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import threading
from collections.abc import Callable

from kvtierd.daemon_key import DaemonKey
from kvtierd.errors import KvtierError
from kvtierd.index.block_index import RequestId
from kvtierd.index.query_counting import QueryCounting
from kvtierd.index.slot_entry import BlockMeta
from kvtierd.movers.copy_engine import Direction
from kvtierd.tier import AcquiredTierFields, Tier, TierCounts
from kvtierd.tiering import load_decision
from kvtierd.tiering.layout_tiers import Tiers
from kvtierd.tiering.lower_reads import LowerReads
from kvtierd.tiering.lower_tier import ChainRest, LowerTier, Segment
from kvtierd.tiering.lower_tier_adapters import lower_tiers
from kvtierd.tiering.offload import Offloader
from kvtierd.tiering.tier_config import LAYOUT_COST, LayoutCost
from kvtierd.token_bytes import PackableTokenIds, TokenBytes, block_span, pack_optional

log = logging.getLogger(__name__)


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
class AcquiredBlocks(AcquiredTierFields):
    block_ids: list[int]
    # T0's hits, then the blocks being loaded from each lower tier, in the table's order (T3's:
    # present when asked; the ticket says what landed)
    tier_blocks: TierCounts
    ticket: Ticket
    # resolves once every block may be written (evicted contents copied down); None: at once
    writable: concurrent.futures.Future[None] | None = None


class Promoter:
    def __init__(self, tiers: Tiers, offloader: Offloader) -> None:
        self.tiers = tiers
        self.offloader = offloader  # reserves T1 slots (spilling T1's victims to T2 by policy)
        self.reads = LowerReads(tiers, offloader)
        self.levels: list[LowerTier] = lower_tiers(tiers, self.reads)  # T1, T2, T3 when present, in chain order
        self.levels_by_tier = {level.tier: level for level in self.levels}
        self.remeasures = load_decision.Remeasures()  # declined tiers read again in the background, now and then
        self._pending: dict[object, Ticket] = {}
        self._lock = threading.Lock()

    # ----------------------------------------------------------------------------- queries

    def lookup(self, block_hashes: list[DaemonKey], token_ids: PackableTokenIds | None = None, ask_remote: bool = True,
               count_misses: bool = False) -> TierCounts:
        """Where the chain's prefix lives, tier by tier (T3: the keys present; a network round
        trip, skipped when `ask_remote` is False). Changes nothing, but for T3's misses when
        `count_misses` (the caller's chain is a query: t3/remote_tier.py)."""
        token_bytes = pack_optional(token_ids)
        start = self.tiers.index.lookup(block_hashes, token_bytes)
        hits = TierCounts(t0=start)
        for level in self.levels:
            if level.local or ask_remote:
                num_found = level.find(self._rest(block_hashes, token_bytes, start), count_misses)
                hits = hits.replace(level.tier, num_found)
                start += num_found
        return hits

    def declined(self, hits: TierCounts, recompute_s_per_token: float | None | LayoutCost = LAYOUT_COST) -> TierCounts:
        """Of a chain's `hits` (a lookup's), the lower-tier blocks an acquire would not load: the
        tier slower than recomputing its blocks at `recompute_s_per_token`, and every tier after it."""
        cost = self._cost(recompute_s_per_token)
        paths = {level.tier: level.load_path for level in self.levels}
        return load_decision.declined(hits, lambda tier, num_blocks: paths[tier](num_blocks),
                                      self.tiers.layout.block_size, cost, self.remeasures.t1_due)

    def _cost(self, recompute_s_per_token: float | None | LayoutCost) -> float | None:
        return self.tiers.recompute.s_per_token if recompute_s_per_token is LAYOUT_COST else recompute_s_per_token

    def pending(self, request_id: object) -> Ticket | None:
        with self._lock:
            return self._pending.get(request_id)

    # ----------------------------------------------------------------------------- acquire

    def acquire(self, request_id: RequestId, block_hashes: list[DaemonKey], num_extra_blocks: int = 0,
                token_ids: PackableTokenIds | None = None,
                recompute_s_per_token: float | None | LayoutCost = LAYOUT_COST, num_t3_present: int | None = None,
                counting: QueryCounting = QueryCounting.QUERY_AND_HITS) -> AcquiredBlocks:
        """`recompute_s_per_token`: what a lower-tier hit must beat to be loaded (None: load every
        hit). `num_t3_present`: how many of the chain's blocks after the local hits the shared
        store holds, when a lookup just asked (None: ask it). `counting`: whether its chain enters
        the query count (and its declined hits the skipped count) and the blocks it finds the hit
        counts (query_counting.py)."""
        tiers = self.tiers
        token_bytes = pack_optional(token_ids)
        answers = {} if num_t3_present is None else {Tier.T3: num_t3_present}
        cost = self._cost(recompute_s_per_token)
        # The lower tiers' hits are claimed (T1's pinned) before T0 allocates: the allocation evicts
        # T0's cached blocks into T1, whose room must not come from the blocks about to be loaded.
        n0_seen = tiers.index.lookup(block_hashes, token_bytes)
        segments, declined = self._claim(self.levels, block_hashes, token_bytes, n0_seen, cost, answers,
                                         counting.counts)
        allocation = tiers.index.allocate(request_id, block_hashes, num_extra_blocks, token_bytes, counting=counting)
        n0 = allocation.num_hit_blocks
        if n0 != n0_seen:  # T0's hits changed in between (another request): claim again after them
            for segment in segments:
                self.levels_by_tier[segment.tier].release(segment)
            segments, declined = self._claim(self.levels, block_hashes, token_bytes, n0, cost, answers)
        if counting.counts:
            tiers.counters.count_hits(Tier.T0, n0)
            tiers.counters.count_queries(len(block_hashes))
            tiers.counters.count_skipped_slow(declined)
        writable = tiers.write_backs.when_landed(allocation.block_ids[n0:])
        tier_blocks = TierCounts(t0=n0)
        for segment in segments:
            tier_blocks = tier_blocks.replace(segment.tier, len(segment.metas))
        if not tier_blocks.num_lower_blocks:
            return AcquiredBlocks(allocation.block_ids, tier_blocks,
                                  self._ticket_when_writable(allocation.block_ids, n0), writable)
        ticket = Ticket()
        with self._lock:
            self._pending[request_id] = ticket
        targets = allocation.block_ids[n0:]
        # An empty segment is settled before any load starts: a load can finish (and call `done`,
        # on the finalizer thread) before this thread reaches its next line, and `_finish` resolves
        # the ticket only once every segment is settled.
        for segment in segments:
            if not segment.metas:
                segment.num_loaded = 0
        done = lambda: self._finish(request_id, n0, targets, segments, ticket, counting)  # noqa: E731

        def start_loads() -> None:  # on a mover thread: submit may wait for the engine's budget
            first = 0
            for level, segment in zip(self.levels, segments):
                if segment.metas:
                    self._start(level, targets[first:first + len(segment.metas)], segment, done)
                first += len(segment.metas)

        self.after_writable(targets, start_loads)
        return AcquiredBlocks(allocation.block_ids, tier_blocks, ticket, writable)

    def _ticket_when_writable(self, block_ids: list[int], num_ready_blocks: int) -> Ticket:
        """A ticket that resolves once the blocks may be written (at once, usually)."""
        landed = self.tiers.write_backs.when_landed(block_ids)
        if landed is None:
            return Ticket(num_ready_blocks)
        ticket = Ticket()
        landed.add_done_callback(lambda _: ticket.future.set_result(num_ready_blocks))
        return ticket

    def after_writable(self, block_ids: list[int], work: Callable[[], None]) -> None:
        """Dispatch `work` to a mover thread once no write-back is in flight from `block_ids`."""
        tiers = self.tiers
        landed = tiers.write_backs.when_landed(block_ids)
        if landed is None:
            tiers.dispatch(work)
        else:
            landed.add_done_callback(lambda _: tiers.dispatch(work))

    def prefetch(self, block_hashes: list[DaemonKey], token_ids: PackableTokenIds | None = None,
                 hits: TierCounts | None = None) -> int:
        """Start copying the chain's segments below T1 (T2, T3) into T1, at once, those an acquire
        would load (not `declined`); returns how many blocks that is. `hits`: a lookup of the chain
        just before (None: look)."""
        if self.tiers.host is None:
            return 0
        token_bytes = pack_optional(token_ids)
        hits = hits if hits is not None else self.lookup(block_hashes, token_bytes)
        declined = self.declined(hits)
        below_t1 = [level for level in self.levels if level.tier is not Tier.T1 and not declined[level.tier]]
        if not below_t1:
            return 0
        segments, _ = self._claim(below_t1, block_hashes, token_bytes, hits.t0 + hits.t1, None, dict(hits.items()))
        for level, segment in zip(below_t1, segments):
            if segment.metas:  # each on a mover thread of its own: starting a T2 read may wait for the engine
                self.tiers.dispatch(functools.partial(_start_read, level, segment))
        return sum(len(segment.metas) for segment in segments)

    # ----------------------------------------------------------------------------- planning

    def claim_level(self, level: LowerTier, block_hashes: list[DaemonKey], token_bytes: TokenBytes | None,
                    start: int) -> Segment:
        """The level's leading blocks of the chain from block `start` on, protected until
        `level.release` (T1's pinned): a Lookup's promise held for its Acquire (lookup_holds.py)."""
        return level.claim(self._rest(block_hashes, token_bytes, start))

    def _rest(self, block_hashes: list[DaemonKey], token_bytes: TokenBytes | None, start: int) -> ChainRest:
        """The chain from block `start` on."""
        block_size = self.tiers.layout.block_size
        parent = block_hashes[start - 1] if start else self.tiers.index.root
        return ChainRest(block_hashes[start:], parent, block_span(token_bytes, start, None, block_size), block_size)

    def _claim(self, levels: list[LowerTier], block_hashes: list[DaemonKey], token_bytes: TokenBytes | None, start: int,
               cost: float | None, answers: dict[Tier, int],
               count_misses: bool = False) -> tuple[list[Segment], TierCounts]:
        """One segment per level, in chain order: each continues the chain where the one above ended
        (`start`: after T0's hits); empty once the chain is used up, and from the first level whose
        load is slower than recomputing its blocks at `cost` on (None: load every hit), whose
        blocks are returned as declined. `answers`: a Lookup's, by tier (LowerTier.claim);
        `count_misses`: the chain is a query (T3 counts what it lacks)."""
        segments: list[Segment] = []
        declined = TierCounts()
        block_size = self.tiers.layout.block_size
        for level in levels:
            if start == len(block_hashes) or declined.num_blocks:
                segments.append(Segment(level.tier, []))
                continue
            segment = level.claim(self._rest(block_hashes, token_bytes, start), answers.get(level.tier), count_misses)
            num_blocks = len(segment.metas)
            if not (load_decision.worth_loading(num_blocks * block_size, level.load_path(num_blocks), cost)
                    or self.remeasures.t1_due(level.tier)):
                level.release(segment)
                declined = TierCounts.of(level.tier, num_blocks)
                if level.tier is not Tier.T1 and self.tiers.host is not None and self.remeasures.due(level.tier):
                    self.tiers.dispatch(functools.partial(_start_read, level, segment))  # into T1, measured
                segment = Segment(level.tier, [])
            segments.append(segment)
            start += len(segment.metas)
        return segments, declined

    # ----------------------------------------------------------------------------- loading

    def _start(self, level: LowerTier, targets: list[int], segment: Segment, done: Callable[[], None]) -> None:
        """Start one segment's load; one that cannot start is a miss, settled on the finalizer thread."""
        try:
            self._load(level, targets, segment, done)
        except Exception:
            log.exception("starting a load of %d blocks failed", len(targets))

            def settle() -> None:
                if segment.num_loaded is None:
                    segment.num_loaded = 0
                    done()

            self.tiers.finalizer.submit(settle)

    def _load(self, level: LowerTier, targets: list[int], segment: Segment, done: Callable[[], None]) -> None:
        """The level's read into host rows (T2, T3: landing in T1 too; T1: its slots, at once),
        then host → T0 on the load stream."""
        read = level.read(segment)
        if read is None:
            self._upload(level, targets, segment, done)
            return

        def after_read(error: BaseException | None) -> None:
            if error is not None or segment.source is None or not segment.source[1]:  # set when the read returned
                level.release(segment)
                segment.num_loaded = 0
                done()
                return
            self._upload(level, targets, segment, done)

        self.tiers.after(read, after_read)

    def _upload(self, level: LowerTier, targets: list[int], segment: Segment, done: Callable[[], None]) -> None:
        """Decode the read rows (`segment.source`) into the T0 targets; the segment is settled, and
        the level's protection released, once the copy landed or failed."""
        tiers = self.tiers
        assert segment.source is not None  # set by the read
        rows, ids, codec = segment.source
        job = lambda: codec.decode(rows, ids, tiers.pool.tensor, targets[:len(ids)])  # noqa: E731
        try:
            upload = tiers.submit(Direction.HOST_TO_DEVICE, job, len(ids) * codec.slot_nbytes)
        except BaseException:
            level.release(segment)
            raise

        def finalize(error: BaseException | None) -> None:
            level.release(segment)
            segment.num_loaded = 0 if error is not None else len(ids)
            done()

        tiers.after(upload, finalize)

    def _finish(self, request_id: RequestId, start: int, targets: list[int], segments: list[Segment], ticket: Ticket,
                counting: QueryCounting) -> None:
        """When every segment has landed: commit the contiguous prefix that loaded, resolve."""
        if any(s.num_loaded is None for s in segments):
            return
        tiers = self.tiers
        loaded: list[BlockMeta] = []
        for segment in segments:
            num_loaded = segment.num_loaded
            assert num_loaded is not None, "every segment has landed (above)"
            loaded += segment.metas[:num_loaded]
            if num_loaded < len(segment.metas):
                tiers.counters.count_failed_loads(len(segment.metas) - num_loaded)
                break
        num_committed = 0
        if loaded:
            try:
                tiers.index.commit_blocks(request_id, start, [m.block_hash for m in loaded],
                                          b"".join(m.token_ids for m in loaded), loaded[0].parent_hash)
                num_committed = len(loaded)
            except KvtierError as e:  # the request went away meanwhile
                log.info("promoted blocks of %r not committed: %s", request_id, e)
        num_uncounted = num_committed if counting.counts else 0
        for segment in segments:  # the committed blocks, tier by tier in chain order
            num_hits = min(num_uncounted, len(segment.metas))
            tiers.counters.count_hits(segment.tier, num_hits)
            num_uncounted -= num_hits
        with self._lock:
            self._pending.pop(request_id, None)
        ticket.future.set_result(start + num_committed)


def _start_read(level: LowerTier, segment: Segment) -> None:
    """A prefetch's (or a re-measure's) read into T1 (its Transfer is not waited for)."""
    level.read(segment)
