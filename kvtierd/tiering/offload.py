"""Offload: blocks going down the tiers, T0 → T1 → T2, by each edge's policy.

- T0 → T1 `on_evict`: the block index calls `on_t0_evict(victims)` with its lock held, before
  the victims' content is dropped and their blocks handed to a new holder. The hook only plans:
  it reserves T1 slots (STORING: invisible to lookups) and registers the victims as write-backs
  (write_backs.py: nobody writes them until their bytes have landed); a mover thread copies. A
  victim that finds no T1 slot (every one in flight) is dropped, counted: an eviction cannot wait.
- T0 → T1 `write_through`: `after_commit` holds freshly committed blocks in T0 (neither evicted
  nor reused) and the write-through thread copies them down as T1 slots can be had, waiting for
  them within a bound (write_through.py: what waits longer is dropped from the edge, counted).
- T1 → T2 `write_through`: every block stored in T1 is written to T2 in the background, pinned in
  T1 from the instant its store completes (SlotIndex.complete_store(pin=True)) until written, so
  T1 never evicts it first; what T2 does not take is counted (lower_tier_adapters.py). `on_evict`: the
  rows of entries T1 evicts are copied out of their slots before the slots are reused, then
  written to T2 on the spill thread (spills.py: a slow disk delays only the evictions that feed it).
- Into T3 (the shared store), from T1 (`t1_to_t3`: write_through or on_evict) or T2 (`t2_to_t3`:
  write_through): the rows are framed (copied) on the thread that has them and queued for the
  store's writer (t3/remote_writes.py: bounded, dropped beyond its backlog), never waited for.
  A Put's blocks go to T3 batch by batch as they arrive when T0 → T1 → T3 is write-through.
Both write-through edges out of T0 and T1 run one batch at a time (serial_batches.py): the commits
that come while a batch goes down go down together in the next, so a busy edge pays its fixed costs
(the copy job's hand-offs, the disk's sync and index commits) once for many commits.
The edges out of T1 and T2 loop over the tiers below that take offers (T2 and T3, the
StoringTier adapters of lower_tier_adapters.py), farthest first: T3's offer only queues, T2's waits on
the disk, so T3 is never held up behind it. What a tier took goes on down its own write-through
edges (T2 → T3). A failed copy completes its store with success=False: no entry points at bytes
that did not land.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import time
from collections.abc import Callable, Sequence

import torch

from kvtierd.daemon_key import DaemonKey
from kvtierd.index.block_index import RequestId
from kvtierd.index.kv_block import KVBlock
from kvtierd.index.slot_entry import BlockMeta, SlotEntry, StorePlan
from kvtierd.movers.block_codec import BlockCodec
from kvtierd.movers.copy_engine import Direction, Job
from kvtierd.t1.host_tier import HostTier
from kvtierd.tier import Edge, Tier
from kvtierd.tiering.layout_tiers import Tiers, recoded
from kvtierd.tiering.lower_tier import LowerTier, Rows, StoringTier
from kvtierd.tiering.serial_batches import SerialBatches
from kvtierd.tiering.spills import Spills
from kvtierd.tiering.tier_config import EdgePolicy
from kvtierd.tiering.write_through import HeldBatch, WriteThroughBacklog
from kvtierd.token_bytes import TokenBytes, tokens_of_blocks

log = logging.getLogger(__name__)

MAX_BATCH_BYTES = 64 << 20  # the most one batch of a write-through edge moves (one piece always goes whole)


@dataclasses.dataclass(frozen=True)
class _Committed:
    """One commit's blocks, held in T0 for the write-through T0 → T1 (`block_of`: T0's block of each hash)."""
    metas: list[BlockMeta]
    block_of: dict[DaemonKey, int]
    held: HeldBatch
    deadline: float  # monotonic: until when they may wait for T1 slots


class Offloader:
    def __init__(self, tiers: Tiers) -> None:
        self.tiers = tiers
        self._holder_ids = itertools.count()
        self.spills = Spills(lambda work: tiers.dispatch(work, tiers.spiller))
        self._stores: list[StoringTier] = []  # the tiers below T1 that take offers, farthest first
        self.backlog = WriteThroughBacklog(tiers.config.write_through_wait_s)  # T0 → T1 write-through's holds
        # The write-through edges out of T0 and out of T1, one batch at a time each: the commits that come
        # while one runs go down together (serial_batches.py).
        max_blocks = max(1, MAX_BATCH_BYTES // max(1, tiers.layout.bytes_per_block))
        self.through_batches = SerialBatches[_Committed](self._write_through_batch, lambda c: len(c.metas), max_blocks)
        self.down_batches = SerialBatches[list[SlotEntry]](self._write_down_batch, len, max_blocks)

    @property
    def _host(self) -> HostTier:
        """T1, on the paths that run only with one (each way in checks `tiers.host`)."""
        host = self.tiers.host
        assert host is not None, "T1 is on"
        return host

    def connect(self, levels: Sequence[LowerTier]) -> None:
        """The lower tiers (lower_tier_adapters.py): the edges out of T1 and T2 offer to those that store."""
        stores = [level for level in levels if isinstance(level, StoringTier)]
        self._stores = sorted(stores, key=lambda store: store.tier.level, reverse=True)
        if self.tiers.host is not None:  # a shed of T1's share evicts as a store does: its victims go down too
            self.tiers.host.share.on_shed_evicted = self.spill_t1_evicted

    # ----------------------------------------------------------------------------- T0 → T1

    def on_t0_evict(self, victims: list[KVBlock]) -> None:
        """The block index's eviction hook (its lock is held): plan the copy down of what T1
        lacks and hand it to a mover thread. No copy, no disk, no wait here."""
        tiers = self.tiers
        if tiers.host is None:
            return
        if tiers.config.t0_to_t1 is not EdgePolicy.ON_EVICT:  # retained blocks are demoted, whatever the policy
            victims = [b for b in victims if tiers.hints.is_retained(b.meta().block_hash)]
            if not victims:
                return
        metas = [b.meta() for b in victims]
        plan = self.prepare_t1_store(metas)
        tiers.counters.count_dropped_offloads(Edge.T0_T1, len(plan.unplaced))  # an eviction cannot wait for room
        if not plan.stores:
            return
        block_of = {b.block_hash: b.block_id for b in victims}
        block_ids = [block_of[e.block_hash] for e in plan.stores]
        in_flight = tiers.write_backs.begin(block_ids)
        tiers.dispatch(lambda: self._write_back(block_ids, plan, in_flight))

    def _write_back(self, block_ids: list[int], plan: StorePlan, in_flight: tuple[int, ...]) -> None:
        """On a mover thread: T1's victims out of their slots, the T0 victims into them, then the
        T0 blocks are free to be written; T1's victims go on to T2."""
        tiers = self.tiers
        try:
            self.spill_t1_victims(plan)
            tiers.run(Direction.DEVICE_TO_HOST, self._encode_job(block_ids, plan.stores),
                      len(plan.stores) * self._host.codec.slot_nbytes)
        except Exception:
            log.exception("offloading %d evicted blocks to the host tier failed", len(plan.stores))
            self._host.index.complete_store(plan.stores, success=False)
            tiers.counters.count_failed_offloads(len(plan.stores))
            return
        finally:
            tiers.write_backs.end(in_flight)
        self._t1_stored(plan.stores)

    def after_commit(self, request_id: RequestId, start_position: int, block_hashes: list[DaemonKey],
                     token_bytes: TokenBytes, parent_hash: DaemonKey) -> None:
        """Write-through T0 → T1 of blocks just committed (a no-op under other policies): held in
        T0 now, copied down on the write-through thread. Never waits (the caller may be the loop)."""
        tiers = self.tiers
        if tiers.host is None or tiers.config.t0_to_t1 is not EdgePolicy.WRITE_THROUGH or not block_hashes:
            return
        parents = [parent_hash, *block_hashes[:-1]]
        # whole blocks or none at all, as commit_blocks checked
        block_tokens = tokens_of_blocks(token_bytes, len(block_hashes), tiers.layout.block_size)
        metas = [BlockMeta(h, p, tokens) for h, p, tokens in zip(block_hashes, parents, block_tokens)]
        block_ids = tiers.index.block_table(request_id)[start_position:start_position + len(block_hashes)]
        holder = ("write-through", next(self._holder_ids))
        tiers.index.hold(holder, block_ids)  # neither evicted nor reused until the copy landed
        held = self.backlog.hold(len(block_ids), functools.partial(tiers.index.free, holder))
        # A block reused before the hold (its request released meanwhile) no longer holds its hash.
        block_of = {m.block_hash: block_id for m, block_id in zip(metas, block_ids)
                    if tiers.index.blocks[block_id].block_hash == m.block_hash}
        metas = [m for m in metas if m.block_hash in block_of]
        self.through_batches.add(_Committed(metas, block_of, held, self.backlog.deadline()))

    def _write_through_batch(self, batch: list[_Committed], done: Callable[[], None]) -> None:
        """Start the write-through of commits' blocks as one (a hash committed twice goes once): their
        holds end, and `done` is called, once every copy of the batch landed or failed."""
        metas: list[BlockMeta] = []
        block_of: dict[DaemonKey, int] = {}
        for committed in batch:
            for meta in committed.metas:
                if meta.block_hash not in block_of:
                    block_of[meta.block_hash] = committed.block_of[meta.block_hash]
                    metas.append(meta)

        def release() -> None:
            try:
                for committed in batch:
                    committed.held.end_part()
            finally:
                done()

        held = HeldBatch(release)
        deadline = min(committed.deadline for committed in batch)
        self.tiers.dispatch(lambda: self._write_through(metas, block_of, held, deadline), self.tiers.through)

    def _write_through(self, metas: list[BlockMeta], block_of: dict[DaemonKey, int], held: HeldBatch,
                       deadline: float) -> None:
        """On the write-through thread: T1 slots for the blocks, as many as T1 gives at a time, each
        part's copy started at once; waits for T1 to change while some lack a slot, until
        `deadline`; those still without one are dropped from the edge, counted. The T0 hold goes
        once the wait and every copy ended."""
        host = self._host
        try:
            while metas:
                plan = self.prepare_t1_store(metas)
                metas = plan.unplaced
                if plan.stores:
                    held.add_part()
                    self._copy_committed([block_of[e.block_hash] for e in plan.stores], plan, held)
                if metas and not host.index.wait_for_room(plan, deadline - time.monotonic()):
                    break
            if metas:
                self.tiers.counters.count_dropped_offloads(Edge.T0_T1, len(metas))
                log.warning("write-through T0 -> T1 dropped %d blocks: no T1 slot free of copies in flight within "
                            "policy.write_through_wait_s = %g s", len(metas), self.backlog.wait_s)
        finally:
            held.end_part()

    def _copy_committed(self, block_ids: list[int], plan: StorePlan, held: HeldBatch) -> None:
        """Copy committed T0 blocks into the slots of `plan` (T1's victims spilled first); ends a
        part of `held` once landed or failed."""
        tiers = self.tiers

        def finalize(error: BaseException | None) -> None:
            try:
                if error is not None:
                    self._host.index.complete_store(plan.stores, success=False)
                    tiers.counters.count_failed_offloads(len(plan.stores))
                else:
                    self._t1_stored(plan.stores)
            finally:
                held.end_part()

        try:
            self.spill_t1_victims(plan)
            transfer = tiers.submit(Direction.DEVICE_TO_HOST, self._encode_job(block_ids, plan.stores),
                                    len(plan.stores) * self._host.codec.slot_nbytes)
        except Exception:
            log.exception("copying %d committed blocks to the host tier failed", len(plan.stores))
            finalize(RuntimeError("not submitted"))
            return
        tiers.after(transfer, finalize)

    def _encode_job(self, block_ids: list[int], entries: list[SlotEntry]) -> Job:
        tiers = self.tiers
        slot_ids = [e.slot for e in entries]
        return lambda: self._host.codec.encode(tiers.pool.tensor, block_ids, self._host.slots, slot_ids)

    def prepare_t1_store(self, metas: list[BlockMeta]) -> StorePlan:
        """Reserve T1 slots (in memory only). Every store into T1 (offload or promotion) reserves
        through here, and calls `spill_t1_victims(plan)` before it writes the slots."""
        return self._host.index.prepare_store(metas)

    def spill_t1_victims(self, plan: StorePlan) -> None:
        """Offer the entries T1 evicted for `plan` down (spill_t1_evicted), before its slots are
        overwritten. Call it off the event loop and without the index lock, before writing the
        plan's slots: it waits while the spill backlog is full."""
        self.spill_t1_evicted(plan.evicted)

    def spill_t1_evicted(self, evicted: list[SlotEntry]) -> None:
        """Offer entries T1 evicted (for a store, or a shed of its share: host_share.py), bytes still
        in their slots, down each on_evict edge out of T1, and the retained ones to T2 whatever the
        edge: T3 frames (copies) them at once; for T2 their rows are copied out and written on the
        spill thread (spills.py)."""
        if not evicted:
            return
        codec, rows = self._host.codec, self._t1_rows(evicted)
        for store, edge in self._stores_below(Tier.T1, EdgePolicy.ON_EVICT):
            self._spill(store, edge, evicted, _in_codec(codec, rows, store.codec))
        retained = [i for i, e in enumerate(evicted) if self.tiers.hints.is_retained(e.block_hash)]
        if not retained:
            return
        entries, retained_rows = [evicted[i] for i in retained], [rows[i] for i in retained]
        for store, edge in self._stores_below(Tier.T1, EdgePolicy.OFF) + self._stores_below(
                Tier.T1, EdgePolicy.WRITE_THROUGH):
            if store.tier is Tier.T2:  # demoted, not dropped (T2's store skips what it holds)
                self._spill(store, edge, entries, _in_codec(codec, retained_rows, store.codec))

    def _spill(self, store: StoringTier, edge: Edge, entries: list[SlotEntry], rows: Rows) -> None:
        """Offer T1's evicted `entries` (`rows` in the store's codec) to `store`: on the spill thread
        for a store that waits on a disk (a copy of the rows, taken now), at once for one that queues."""
        if store.offer_waits:
            copied = torch.stack(rows) if isinstance(rows, list) else rows
            self.spills.queue(entries, copied, functools.partial(self._offer, store, edge))
        else:
            self._offer(store, edge, entries, rows)

    # ----------------------------------------------------------------------------- T1 → T2, T3

    def _t1_stored(self, entries: list[SlotEntry]) -> None:
        """A copy from T0 landed in T1's slots: the entries turn READY, and go on down the
        write-through edges out of T1 (to T2, T3), pinned from that instant until written (T2) or
        framed (T3), so no store into T1 evicts them first."""
        tiers = self.tiers
        stores = self._stores_below(Tier.T1, EdgePolicy.WRITE_THROUGH)
        self._host.index.complete_store(entries, success=True, pin=bool(stores))
        tiers.counters.count_offloaded(Edge.T0_T1, len(entries))
        if stores and entries:
            self.down_batches.add(entries)

    def _write_down_batch(self, batch: list[list[SlotEntry]], done: Callable[[], None]) -> None:
        """Write T1's entries of `batch` down the write-through edges out of T1 as one offer to each
        tier below (one disk write, one sync); unpinned, and `done` called, once written or failed."""
        tiers = self.tiers
        stores = self._stores_below(Tier.T1, EdgePolicy.WRITE_THROUGH)
        entries = [entry for piece in batch for entry in piece]

        def write() -> None:
            rows = self._t1_rows(entries)
            for store, edge in stores:
                self._offer(store, edge, entries, _in_codec(self._host.codec, rows, store.codec))

        try:
            transfer = tiers.submit(Direction.HOST_TO_HOST, write, len(entries) * self._host.codec.slot_nbytes)
        except Exception:  # the engine closed: nothing written down
            log.exception("writing %d blocks down from the host tier failed", len(entries))
            tiers.counters.count_failed_offloads(len(entries))
            self._host.index.unpin(entries)
            done()
            return

        def written(error: BaseException | None) -> None:
            try:
                if error is not None:
                    log.error("writing %d blocks down from the host tier failed: %s", len(entries), error)
                    tiers.counters.count_failed_offloads(len(entries))
                self._host.index.unpin(entries)
            finally:
                done()

        tiers.after(transfer, written)

    def _stores_below(self, tier: Tier, policy: EdgePolicy) -> list[tuple[StoringTier, Edge]]:
        """The tiers below `tier` that take offers and whose edge from it has `policy`, with that
        edge; farthest first."""
        config = self.tiers.config
        return [(store, edge) for store in self._stores
                if store.tier.level > tier.level and config.policy(edge := Edge.between(tier, store.tier)) is policy]

    def _offer(self, store: StoringTier, edge: Edge, entries: list[SlotEntry], rows: Rows) -> int:
        """Offer blocks to `store` (`rows` in its codec); what it took goes on down its
        write-through edges (T2 → T3). How many it took."""
        num_taken = store.offer(entries, rows, edge)
        if num_taken:
            for lower, lower_edge in self._stores_below(store.tier, EdgePolicy.WRITE_THROUGH):
                self._offer(lower, lower_edge, entries, _in_codec(store.codec, rows, lower.codec))
        return num_taken

    # ----------------------------------------------------------------------------- into T3

    def _t1_rows(self, entries: list[SlotEntry]) -> list[torch.Tensor]:
        """Views of the entries' T1 slots (no copy: framing copies them)."""
        slots = self._host.slots
        return [slots[e.slot] for e in entries]

    def offer_received_to_t3(self, metas: list[BlockMeta], payloads: list[memoryview]) -> None:
        """Blocks a client just put into T0, as received (`payloads`: raw block bytes that stay
        unchanged until written), queued for T3 at once when every edge from T0 to T3 is
        write-through (so they would reach it anyway, after the Put's commit and T1's copy) and T3
        stores raw blocks. Counted as the T1 → T3 edge's: the write that edge would have made.
        The T1 → T3 write-through that follows finds them queued and skips them."""
        tiers = self.tiers
        config = tiers.config
        if (tiers.remote is None or tiers.host is None or tiers.remote_codec is None or tiers.remote_codec.name != "raw"
                or config.t0_to_t1 is not EdgePolicy.WRITE_THROUGH or config.t1_to_t3 is not EdgePolicy.WRITE_THROUGH):
            return
        tiers.counters.count_offloaded(Edge.T1_T3, tiers.remote.offer(metas, payloads, copy=False))


def _in_codec(codec: BlockCodec, rows: Rows, target: BlockCodec) -> Rows:
    """`rows` of `codec` (a tensor, or one view per block) in `target`'s codec: the same rows when
    the codecs agree, else converted on the host (a new tensor)."""
    if codec.name == target.name:
        return rows
    return recoded(codec, torch.stack(list(rows)) if isinstance(rows, list) else rows, target)
