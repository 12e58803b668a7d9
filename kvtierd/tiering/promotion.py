"""Promotion: prefix hits in T1 and T2 copied up into freshly allocated T0 blocks.

`acquire` allocates the request's blocks in T0 (T0 hits first), then continues the hash chain
in T1 and after that in T2. Each lower-tier segment is loaded only if its copy is expected to be
faster than recomputing its tokens (tier_config.worth_loading). Loads run in the background,
submitted from a mover thread once the targets' evicted bytes have landed (write_backs.py);
the caller gets a Ticket whose result is how many leading blocks are ready in T0: it computes
the rest. Protection while in flight: the T0 targets are held by the request itself, T1 entries
are pinned (prepare_load), T2 entries are pinned by the SSD tier during its read. Promoted
blocks are committed in T0 only when every segment before them landed, so a failed transfer is
a miss — the runner recomputes into blocks that are still its own — and never a hit.
T2 hits also land in T1 on their way up (inclusive tiers). `prefetch` runs that T2 → T1 step
ahead of use, while a request still queues.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import threading

import torch

from kvtierd.block_hash import pack_token_ids
from kvtierd.errors import KvtierError
from kvtierd.index.slot_index import BlockMeta, SlotEntry
from kvtierd.movers.copy_engine import Direction
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
    ticket: Ticket
    # resolves once every block may be written (evicted contents copied down); None: at once
    writable: concurrent.futures.Future[None] | None = None


@dataclasses.dataclass(frozen=True)
class TierHits:
    """Leading blocks of a chain found in each tier, in chain order (t0 first)."""

    t0: int
    t1: int
    t2: int


@dataclasses.dataclass
class _Segment:
    """One tier's part of a promotion; touched only on the finalizer thread once in flight."""

    metas: list[BlockMeta]
    num_loaded: int | None = None  # None while in flight
    source: tuple | None = None  # T2 only, once read: (rows, row ids, codec) the upload decodes from


class Promoter:
    def __init__(self, tiers: Tiers, offloader: Offloader) -> None:
        self.tiers = tiers
        self.offloader = offloader  # reserves T1 slots (spilling T1's victims to T2 by policy)
        self._pending: dict[object, Ticket] = {}
        self._lock = threading.Lock()

    # ----------------------------------------------------------------------------- queries

    def lookup(self, block_hashes: list[bytes], token_ids=None) -> TierHits:
        """Where the chain's prefix lives, tier by tier. Changes nothing."""
        tiers = self.tiers
        token_bytes = pack_token_ids(token_ids) if token_ids is not None else None
        n0 = tiers.index.lookup(block_hashes, token_bytes)
        n1 = n2 = 0
        if tiers.host is not None:
            n1 = tiers.host.index.lookup(*self._rest(block_hashes, token_bytes, n0))
        if tiers.ssd is not None:
            n2 = tiers.ssd.lookup(*self._rest(block_hashes, token_bytes, n0 + n1))
        return TierHits(n0, n1, n2)

    def pending(self, request_id: object) -> Ticket | None:
        with self._lock:
            return self._pending.get(request_id)

    # ----------------------------------------------------------------------------- acquire

    def acquire(self, request_id, block_hashes: list[bytes], num_extra_blocks: int = 0, token_ids=None,
                recompute_s_per_token=_FROM_CONFIG) -> AcquiredBlocks:
        tiers = self.tiers
        cost = tiers.config.recompute_s_per_token if recompute_s_per_token is _FROM_CONFIG else recompute_s_per_token
        token_bytes = pack_token_ids(token_ids) if token_ids is not None else None
        allocation = tiers.index.allocate(request_id, block_hashes, num_extra_blocks, token_bytes)
        n0 = allocation.num_hit_blocks
        t1_entries = self._t1_hits(block_hashes, token_bytes, n0, cost)
        t2_metas = self._t2_hits(block_hashes, token_bytes, n0 + len(t1_entries), cost)
        tiers.counters.add("num_hit_blocks", n0, "t0")
        tiers.counters.add("num_query_blocks", len(block_hashes))
        writable = tiers.write_backs.when_landed(allocation.block_ids[n0:])
        if not t1_entries and not t2_metas:
            return AcquiredBlocks(allocation.block_ids, n0, 0, 0, self._ticket_when_writable(allocation.block_ids, n0),
                               writable)
        ticket = Ticket()
        with self._lock:
            self._pending[request_id] = ticket
        targets = allocation.block_ids[n0:]
        segments = [_Segment([e.meta for e in t1_entries]), _Segment(t2_metas)]
        # An empty segment is settled before any load starts: a load can finish (and call `done`,
        # on the finalizer thread) before this thread reaches its next line, and `_finish` resolves
        # the ticket only once every segment is settled.
        for segment in segments:
            if not segment.metas:
                segment.num_loaded = 0
        done = lambda: self._finish(request_id, n0, targets, segments, ticket)  # noqa: E731

        def start_loads() -> None:  # on a mover thread: submit may wait for the engine's budget
            if t1_entries:
                self._start(self._load_t1, t1_entries, targets[:len(t1_entries)], segments[0], done)
            if t2_metas:
                self._start(self._load_t2, t2_metas, targets[len(t1_entries):], segments[1], done)

        self.after_writable(targets, start_loads)
        return AcquiredBlocks(allocation.block_ids, n0, len(t1_entries), len(t2_metas), ticket, writable)

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

    def prefetch(self, block_hashes: list[bytes], token_ids=None) -> int:
        """Start copying the chain's T2 segment into T1; returns how many blocks that is."""
        tiers = self.tiers
        if tiers.host is None or tiers.ssd is None:
            return 0
        token_bytes = pack_token_ids(token_ids) if token_ids is not None else None
        hits = self.lookup(block_hashes, token_bytes)
        metas = self._t2_hits(block_hashes, token_bytes, hits.t0 + hits.t1, None)
        if metas:
            segment = _Segment(metas)
            tiers.dispatch(lambda: tiers.engine.submit(Direction.HOST_TO_HOST, lambda: self._read_t2_into_t1(segment),
                                                       len(metas) * tiers.ssd_codec.slot_nbytes))
        return len(metas)

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

    # ----------------------------------------------------------------------------- loading

    def _start(self, load, items, targets: list[int], segment: _Segment, done) -> None:
        """Start one segment's load; one that cannot start is a miss, settled on the finalizer thread."""
        try:
            load(items, targets, segment, done)
        except Exception:
            log.exception("starting a load of %d blocks failed", len(targets))

            def settle() -> None:
                if segment.num_loaded is None:
                    segment.num_loaded = 0
                    done()

            self.tiers.finalizer.submit(settle)

    def _load_t1(self, entries: list[SlotEntry], targets: list[int], segment: _Segment, done) -> None:
        tiers = self.tiers
        slot_ids = [e.slot for e in entries]
        job = lambda: tiers.host.codec.decode(tiers.host.slots, slot_ids, tiers.pool.tensor, targets)  # noqa: E731
        try:
            transfer = tiers.engine.submit(Direction.HOST_TO_DEVICE, job, len(entries) * tiers.host.codec.slot_nbytes)
        except BaseException:
            tiers.host.index.unpin(entries)
            raise

        def finalize(error: BaseException | None) -> None:
            tiers.host.index.unpin(entries)
            segment.num_loaded = 0 if error is not None else len(entries)
            done()

        tiers.after(transfer, finalize)

    def _load_t2(self, metas: list[BlockMeta], targets: list[int], segment: _Segment, done) -> None:
        """SSD → host (landing in T1 too) on a host thread, then host → T0 on the load stream."""
        tiers = self.tiers
        read = tiers.engine.submit(Direction.HOST_TO_HOST, lambda: self._read_t2_into_t1(segment),
                                   len(metas) * tiers.ssd_codec.slot_nbytes)

        def after_read(error: BaseException | None) -> None:
            if error is not None or not segment.source[1]:  # source is set when the read returned
                segment.num_loaded = 0
                done()
                return
            rows, ids, codec = segment.source
            job = lambda: codec.decode(rows, ids, tiers.pool.tensor, targets[:len(ids)])  # noqa: E731
            upload = tiers.engine.submit(Direction.HOST_TO_DEVICE, job, len(ids) * codec.slot_nbytes)

            def after_upload(upload_error: BaseException | None) -> None:
                segment.num_loaded = 0 if upload_error is not None else len(ids)
                done()

            tiers.after(upload, after_upload)

        tiers.after(read, after_read)

    def _read_t2_into_t1(self, segment: _Segment) -> None:
        """Read the segment's blocks from T2 (verified) and store them in T1. Sets the rows the
        upload decodes from: T1 slots when T1 took every block in the same codec (read into
        directly, O_DIRECT without staging), else a host buffer."""
        tiers = self.tiers
        metas = segment.metas
        hashes = [m.block_hash for m in metas]
        host = tiers.host
        plan = self.offloader.prepare_t1_store(metas) if host is not None else None
        if plan is not None:
            self.offloader.spill_t1_victims(plan)
        direct = plan is not None and len(plan.stores) == len(metas) and host.codec.name == tiers.ssd_codec.name
        if direct:
            slot_ids = [e.slot for e in plan.stores]
            with tiers.ssd_read.measure(len(metas) * tiers.ssd_codec.slot_nbytes):
                num_read = tiers.ssd.load(hashes, [host.slots[s] for s in slot_ids], parent=metas[0].parent_hash)
            host.index.complete_store(plan.stores[:num_read], success=True)
            host.index.complete_store(plan.stores[num_read:], success=False)
            segment.source = (host.slots, slot_ids[:num_read], host.codec)
        else:
            raw = torch.empty((len(metas), tiers.ssd_codec.slot_nbytes), dtype=torch.uint8)
            with tiers.ssd_read.measure(raw.numel()):
                num_read = tiers.ssd.load(hashes, raw, parent=metas[0].parent_hash)
            if host is None:
                segment.source = (raw, list(range(num_read)), tiers.ssd_codec)
            else:
                rows = tiers.t2_rows_for_t1(raw[:num_read])
                row_of = {m.block_hash: i for i, m in enumerate(metas[:num_read])}
                stored = [e for e in plan.stores if e.block_hash in row_of]
                for entry in stored:
                    host.slots[entry.slot].copy_(rows[row_of[entry.block_hash]])
                host.index.complete_store(stored, success=True)
                host.index.complete_store([e for e in plan.stores if e.block_hash not in row_of], success=False)
                segment.source = (rows, list(range(num_read)), host.codec)
        if num_read < len(metas):
            tiers.counters.add("num_failed_load_blocks", len(metas) - num_read)

    def _finish(self, request_id, start: int, targets: list[int], segments: list[_Segment], ticket: Ticket) -> None:
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
        tiers.counters.add("num_hit_blocks", min(num_committed, len(segments[0].metas)), "t1")
        tiers.counters.add("num_hit_blocks", max(0, num_committed - len(segments[0].metas)), "t2")
        with self._lock:
            self._pending.pop(request_id, None)
        ticket.future.set_result(start + num_committed)
