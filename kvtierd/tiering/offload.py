"""Offload: blocks going down the tiers, T0 → T1 → T2, by each edge's policy.

- T0 → T1 `on_evict`: the block index calls `on_t0_evict(victims)` with its lock held, before
  the victims' content is dropped and their blocks handed to a new holder. The hook only plans:
  it reserves T1 slots (STORING: invisible to lookups) and registers the victims as write-backs
  (write_backs.py: nobody writes them until their bytes have landed); a mover thread copies.
- T0 → T1 `write_through`: `after_commit` copies freshly committed blocks down in the background
  while a hold keeps them from being evicted or reused until the copy has landed.
- T1 → T2 `write_through`: every block stored in T1 is written to T2 in the background, pinned in
  T1 meanwhile. `on_evict`: the rows of entries T1 evicts are copied out of their slots before
  the slots are reused, then written to T2 on the spill thread (spills.py: a slow disk delays
  only the evictions that feed it).
- Into T3 (the shared store), from T1 (`t1_to_t3`: write_through or on_evict) or T2 (`t2_to_t3`:
  write_through): the rows are framed (copied) on the thread that has them and queued for the
  store's writer (t3/remote_writes.py: bounded, dropped beyond its backlog), never waited for.
  A Put's blocks go to T3 batch by batch as they arrive when T0 → T1 → T3 is write-through.
A failed copy completes its store with success=False: no entry points at bytes that did not land.
"""

from __future__ import annotations

import itertools
import logging

import torch

from kvtierd.index.kv_block import KVBlock
from kvtierd.index.slot_entry import BlockMeta, SlotEntry, StorePlan
from kvtierd.movers.copy_engine import Direction
from kvtierd.tiering.spills import Spills
from kvtierd.tiering.tier_config import EdgePolicy
from kvtierd.tiering.tiers import Tiers, recoded

log = logging.getLogger(__name__)


class Offloader:
    def __init__(self, tiers: Tiers) -> None:
        self.tiers = tiers
        self._holder_ids = itertools.count()
        self.spills = Spills(lambda work: tiers.dispatch(work, tiers.spiller), self._store_t2)

    # ----------------------------------------------------------------------------- T0 → T1

    def on_t0_evict(self, victims: list[KVBlock]) -> None:
        """The block index's eviction hook (its lock is held): plan the copy down of what T1
        lacks and hand it to a mover thread. No copy, no disk, no wait here."""
        tiers = self.tiers
        if tiers.host is None or tiers.config.t0_to_t1 is not EdgePolicy.ON_EVICT:
            return
        metas = [BlockMeta(b.block_hash, b.parent_hash, b.token_ids) for b in victims]
        plan = self.prepare_t1_store(metas)
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
                      len(plan.stores) * tiers.host.codec.slot_nbytes)
        except Exception:
            log.exception("offloading %d evicted blocks to the host tier failed", len(plan.stores))
            tiers.host.index.complete_store(plan.stores, success=False)
            tiers.counters.add("num_failed_offload_blocks", len(plan.stores))
            return
        finally:
            tiers.write_backs.end(in_flight)
        tiers.host.index.complete_store(plan.stores, success=True)
        tiers.counters.add("num_offloaded_blocks", len(plan.stores), "t0_t1")
        self._after_t1_store(plan.stores)

    def after_commit(self, request_id, start_position: int, block_hashes: list[bytes], token_bytes: bytes,
                     parent_hash: bytes) -> None:
        """Write-through T0 → T1 of blocks just committed (a no-op under other policies)."""
        tiers = self.tiers
        if tiers.host is None or tiers.config.t0_to_t1 is not EdgePolicy.WRITE_THROUGH or not block_hashes:
            return
        stride = 4 * tiers.layout.block_size
        metas = [BlockMeta(h, p, token_bytes[i * stride:(i + 1) * stride])
                 for i, (h, p) in enumerate(zip(block_hashes, [parent_hash, *block_hashes[:-1]]))]
        block_ids = tiers.index.block_table(request_id)[start_position:start_position + len(block_hashes)]
        holder = ("write-through", next(self._holder_ids))
        tiers.index.hold(holder, block_ids)  # neither evicted nor reused until the copy landed
        # A block reused before the hold (its request released meanwhile) no longer holds its hash.
        block_of = {m.block_hash: block_id for m, block_id in zip(metas, block_ids)
                    if tiers.index.blocks[block_id].block_hash == m.block_hash}
        plan = self.prepare_t1_store([m for m in metas if m.block_hash in block_of])
        if not plan.stores:
            tiers.index.free(holder)
            return
        stored_ids = [block_of[e.block_hash] for e in plan.stores]

        def finalize(error: BaseException | None) -> None:
            tiers.index.free(holder)
            tiers.host.index.complete_store(plan.stores, success=error is None)
            if error is not None:
                tiers.counters.add("num_failed_offload_blocks", len(plan.stores))
                return
            tiers.counters.add("num_offloaded_blocks", len(plan.stores), "t0_t1")
            self._after_t1_store(plan.stores)

        def copy_down() -> None:  # on a mover thread: submit may wait for the engine's budget
            try:
                self.spill_t1_victims(plan)
                transfer = tiers.submit(Direction.DEVICE_TO_HOST, self._encode_job(stored_ids, plan.stores),
                                        len(plan.stores) * tiers.host.codec.slot_nbytes)
            except Exception:
                log.exception("copying %d committed blocks to the host tier failed", len(plan.stores))
                finalize(RuntimeError("not submitted"))
                return
            tiers.after(transfer, finalize)

        tiers.dispatch(copy_down)

    def _encode_job(self, block_ids: list[int], entries: list[SlotEntry]):
        tiers = self.tiers
        slot_ids = [e.slot for e in entries]
        return lambda: tiers.host.codec.encode(tiers.pool.tensor, block_ids, tiers.host.slots, slot_ids)

    def prepare_t1_store(self, metas: list[BlockMeta]) -> StorePlan:
        """Reserve T1 slots (in memory only). Every store into T1 (offload or promotion) reserves
        through here, and calls `spill_t1_victims(plan)` before it writes the slots."""
        return self.tiers.host.index.prepare_store(metas)

    def spill_t1_victims(self, plan: StorePlan) -> None:
        """When T1 → T2 is on_evict: copy the rows of the entries T1 evicted for `plan` out of
        their slots (about to be overwritten) and queue their T2 write (spills.py). Call it off
        the event loop and without the index lock, before writing the plan's slots: it waits
        while the spill backlog is full."""
        tiers = self.tiers
        if not plan.evicted:
            return
        if tiers.remote is not None and tiers.config.t1_to_t3 is EdgePolicy.ON_EVICT:
            self._offer_t3(plan.evicted, tiers.host.codec, self._t1_rows(plan.evicted), "t1_t3")
        if tiers.ssd is not None and tiers.config.t1_to_t2 is EdgePolicy.ON_EVICT:
            self.spills.queue(plan.evicted, tiers.t1_rows_for_t2([e.slot for e in plan.evicted]))  # indexing copies

    # ----------------------------------------------------------------------------- T1 → T2

    def _after_t1_store(self, entries: list[SlotEntry]) -> None:
        """Write-through T1 → T2 and T1 → T3 of entries just stored in T1, pinned until written
        (T2) or framed (T3)."""
        tiers = self.tiers
        to_t2 = tiers.ssd is not None and tiers.config.t1_to_t2 is EdgePolicy.WRITE_THROUGH
        to_t3 = tiers.remote is not None and tiers.config.t1_to_t3 is EdgePolicy.WRITE_THROUGH
        if not (to_t2 or to_t3):
            return
        pinned = tiers.host.index.pin_present([e.block_hash for e in entries])
        if not pinned:
            return

        def write() -> None:
            if to_t3:
                self._offer_t3(pinned, tiers.host.codec, self._t1_rows(pinned), "t1_t3")
            if to_t2:
                self._write_t2(pinned)

        transfer = tiers.submit(Direction.HOST_TO_HOST, write, len(pinned) * tiers.host.codec.slot_nbytes)
        tiers.after(transfer, lambda error: tiers.host.index.unpin(pinned))

    def _write_t2(self, entries: list[SlotEntry]) -> int:
        """Store T1 entries (their slots' current bytes) in T2; returns how many it took."""
        return self._store_t2(entries, self.tiers.t1_rows_for_t2([e.slot for e in entries]))

    def _store_t2(self, entries: list[SlotEntry], rows) -> int:
        """Store `rows` (in T2's codec) under the entries' keys in T2; returns how many it took."""
        tiers = self.tiers
        try:
            with tiers.ssd_write.measure(rows.numel()):
                num_stored = tiers.ssd.store([(e.meta, rows[i]) for i, e in enumerate(entries)])
        except Exception:  # the SSD tier reports its own errors; the host tier keeps serving
            log.exception("writing %d blocks to the SSD tier failed", len(entries))
            tiers.counters.add("num_failed_offload_blocks", len(entries))
            return 0
        tiers.counters.add("num_offloaded_blocks", num_stored, "t1_t2")
        if num_stored and tiers.remote is not None and tiers.config.t2_to_t3 is EdgePolicy.WRITE_THROUGH:
            self._offer_t3(entries, tiers.ssd_codec, rows, "t2_t3")
        return num_stored

    # ----------------------------------------------------------------------------- into T3

    def _t1_rows(self, entries: list[SlotEntry]) -> list:
        """Views of the entries' T1 slots (no copy: framing copies them)."""
        slots = self.tiers.host.slots
        return [slots[e.slot] for e in entries]

    def offer_received_to_t3(self, metas: list[BlockMeta], payloads: list[memoryview]) -> None:
        """Blocks a client just put into T0, as received (`payloads`: raw block bytes that stay
        unchanged until written), queued for T3 at once when every edge from T0 to T3 is
        write-through (so they would reach it anyway, after the Put's commit and T1's copy) and T3
        stores raw blocks. Counted as the T1 → T3 edge's: the write that edge would have made.
        The T1 → T3 write-through that follows finds them queued and skips them."""
        tiers = self.tiers
        config = tiers.config
        if (tiers.remote is None or tiers.host is None or tiers.remote_codec.name != "raw"
                or config.t0_to_t1 is not EdgePolicy.WRITE_THROUGH or config.t1_to_t3 is not EdgePolicy.WRITE_THROUGH):
            return
        tiers.counters.add("num_offloaded_blocks", tiers.remote.offer(metas, payloads, copy=False), "t1_t3")

    def _offer_t3(self, entries: list[SlotEntry], codec, rows, edge: str) -> None:
        """Queue the entries' blocks (`rows` in `codec`: a tensor, or one view per block) for the
        shared store; never waits."""
        tiers = self.tiers
        if codec.name != tiers.remote_codec.name:
            rows = recoded(codec, torch.stack(list(rows)) if isinstance(rows, list) else rows, tiers.remote_codec)
        try:
            num_queued = tiers.remote.offer([e.meta for e in entries], rows)
        except Exception:
            log.exception("framing %d blocks for the T3 store failed", len(entries))
            tiers.counters.add("num_failed_offload_blocks", len(entries))
            return
        tiers.counters.add("num_offloaded_blocks", num_queued, edge)

