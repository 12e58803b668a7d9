"""The T2 SSD tier: blocks in slot files (ssd_files.py), found through a persistent LMDB index
(ssd_index.py) and an in-memory SlotIndex (LRU, two-phase), recovered on open.

Disk: the files grow as blocks are written, in chunks the node's disk budget grants, and shrink
when another layout needs the disk: the least recently used blocks go, the kept ones move out of
the end (ssd_growth.py). With the budget spent, a store reuses this tier's least recently used
slots (prepare_store); with none evictable the blocks are skipped and counted, never an error.

Write order of a store batch, so that a crash at any instant leaves the old state or the new:
  (a) the entries that give up their slots (LRU victims of prepare_store, watermark evictions)
      are deleted from LMDB in one committed transaction, before any of those slots is written;
  (b) the bytes go out with batched pwritev from the I/O threads, checksummed on the way;
  (c) durability per the policy (fdatasync of each touched file);
  (d) one LMDB transaction inserts the new records;
  (e) complete_store(success) makes them visible (or drops them and frees their slots).
Invariant: an LMDB record always names a slot holding exactly its bytes. Slots are freed (by
eviction, remove or a corrupt read) only under `_write_lock`, which also covers prepare_store and
the LMDB delete of what was freed, so nobody writes a freed slot before its record is gone; a
delete that fails stays pending and goes out with the next transaction, before any slot write.

Reads verify length and xxh3_64 checksum: a short read, a mismatch or an I/O error is a miss, the
entry is dropped (SlotIndex and LMDB) and counted, no byte of it reported as loaded. With
`config.tenant_keys` (encryption on) every slot holds its block sealed under its tenant's data key
(ssd_io.py, kvtierd/sealing/): a record that does not open as its own key's is a miss the same way,
counted apart (`num_unauthentic`), and a slot is the block's bytes plus SEAL_OVERHEAD_BYTES. Write errors
(disk full, EIO) stop admission: later stores return 0, the rest keeps working, nothing raises.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence

import lmdb
import numpy as np
import torch
import xxhash

from kvtierd.daemon_key import DaemonKey
from kvtierd.errors import FailedPrecondition, InvalidArgument
from kvtierd.index.extent_slot_index import ExtentSlotIndex
from kvtierd.index.index_events import Doorbell, IndexEvent
from kvtierd.index.owner_slots import slots_within
from kvtierd.index.slot_entry import BlockMeta, SlotEntry
from kvtierd.layout import Layout
from kvtierd.retention.tier_retention import TierRetention
from kvtierd.sealing.block_seal import BlockSealer, seal_context, sealed_nbytes
from kvtierd.t2.directory_lock import SSD_TIER_LOCK_FILE_NAME, DirectoryLock
from kvtierd.t2.node_budget import NodeBudget, truncating_shed
from kvtierd.t2.ssd_config import SsdTierConfig, describe_error
from kvtierd.t2.ssd_drops import SsdDrops
from kvtierd.t2.ssd_files import SlotFiles
from kvtierd.t2.ssd_growth import SsdGrowth, TierCalls, take_budget
from kvtierd.t2.ssd_index import Record, SsdIndex
from kvtierd.t2.ssd_io import BlockBytes, SlotIO, checked_blocks, checked_rows
from kvtierd.t2.ssd_moves import SlotMover
from kvtierd.t2.ssd_recovery import open_sealed_tokens, recover_records
from kvtierd.t2.ssd_stats import SsdStats
from kvtierd.token_bytes import TokenBytes

log = logging.getLogger(__name__)

INDEX_RESERVE_BYTES = 1 << 20  # left free beside the index when the disk cannot hold the capacity


class SsdTier:
    """Thread-safe; every method is synchronous (the tier manager calls it from its threads)."""

    @classmethod
    def open(cls, config: SsdTierConfig, layout: Layout, slot_nbytes: int | None = None, codec: str = "raw") -> SsdTier:
        """`slot_nbytes`: a block's bytes as stored (its codec's; default the layout's); `codec`
        names that encoding, bound into sealed records."""
        slot_nbytes = layout.bytes_per_block if slot_nbytes is None else slot_nbytes
        if not isinstance(slot_nbytes, int) or slot_nbytes <= 0:
            raise InvalidArgument(f"slot_nbytes must be a positive integer, got {slot_nbytes!r}")
        return cls(config, layout, slot_nbytes, codec)

    def __init__(self, config: SsdTierConfig, layout: Layout, slot_nbytes: int, codec: str = "raw") -> None:
        self.config, self.layout, self.slot_nbytes = config, layout, slot_nbytes
        self._layout_id = xxhash.xxh3_64_intdigest(layout.fingerprint())
        sealer = self._sealer = None
        if config.tenant_keys is not None:
            sealer = self._sealer = BlockSealer(config.tenant_keys, seal_context(layout.fingerprint(), codec))
        self.record_nbytes = slot_nbytes if sealer is None else sealed_nbytes(slot_nbytes)  # what a slot holds
        directories = [os.path.abspath(d) for d in config.directories]
        for directory in directories:
            os.makedirs(directory, exist_ok=True)
        self._lock = DirectoryLock.acquire(directories[0], "SSD tier directory", SSD_TIER_LOCK_FILE_NAME,
                                           holder="another tier or process")
        self._reason = ""
        self._db: SsdIndex | None = None
        try:  # the index first: on a short disk the slot files leave it room to grow
            self._db = SsdIndex(directories[0], config.lmdb_map_bytes, config.durability == "fdatasync")
        except (OSError, lmdb.Error) as error:  # an inert tier, says why
            self._reason = describe_error(error, "index open", directories[0])
            log.error("SSD tier: %s", self._reason)
        budget = config.node_budget
        try:
            self._files = SlotFiles(directories if self._db is not None else [], config.capacity_bytes,
                                    self.record_nbytes,
                                    config.o_direct, index_reserve_bytes=INDEX_RESERVE_BYTES)
        except OSError:
            self._lock.release()
            raise
        self._reason = "; ".join(filter(None, [self._reason, *self._files.shortfalls]))
        self.num_slots = self._files.max_slots  # the most the files may hold
        self.stride = self._files.stride
        self._budget: NodeBudget = budget if budget is not None else NodeBudget(self.num_slots * self.stride, "ssd")
        self._budget_key = directories[0]
        extent = take_budget(self._budget, self._budget_key, self._budget.register(self._budget_key),
                             self._files.existing_slots(), self.stride)
        try:
            self._files.resize(extent)  # drops what the budget no longer covers (records past it are dropped)
        except OSError as error:
            log.error("SSD tier: truncating the slot files to %d slots failed: %s", extent, error)
        self._index = ExtentSlotIndex(self.num_slots, extent, clock=time.time)  # wall clock: last use persists
        self.residency = self._index.residency  # how long blocks stayed, by why they left (index/residency.py)
        self._checksums = np.zeros(self.num_slots, dtype=np.uint64)  # per slot, of its holder
        self._write_lock = threading.Lock()  # orders slot reuse against LMDB deletes (see module doc)
        self._pending_deletes: set[DaemonKey] = set()  # under _write_lock
        self._stats_lock = threading.Lock()
        self._touched: dict[DaemonKey, float] = {}  # last uses not yet persisted; under _stats_lock
        self._state = threading.Condition()
        self._num_in_flight, self._closed = 0, False
        self.bytes_written = self.bytes_read = 0
        self.drops = SsdDrops(self._index, self._write_lock, lambda where, deletes: self._commit_index(where, deletes),
                              self._operation, config.max_age_s)  # what reads and the age limit drop, counted
        self.num_recovered = self.num_dropped_on_open = 0
        self.num_full_skips = 0  # blocks not stored: the budget was spent and nothing of this tier evictable
        self._admitting = self.num_slots > 0
        if not self._admitting and not self._reason:
            self._reason = "disk: no slots (capacity below one slot)"
        self._io = SlotIO(self._files, config.num_io_threads, self._checksums, sealer)
        self._growth = SsdGrowth(self._budget, self._budget_key, self._files, self._index, self._write_lock,
                                 SlotMover(self._files, self._io, config.durability == "fdatasync"),
                                 TierCalls(self._commit_index, self._stop_admitting, self._record,
                                           self.drops.count_lost))
        if self._db is not None:
            self._recover(self._db)
        self._budget.register(self._budget_key, self._shed)  # from now on others may ask it to give back

    # ------------------------------------------------------------------------------ open

    def _recover(self, db: SsdIndex) -> None:
        paths = [f.path for f in self._files.files]
        stored_paths = db.files()
        found = recover_records(db, self._files, self._layout_id, self.record_nbytes,
                                paths if stored_paths is None else stored_paths)
        if self._sealer is not None:
            found = open_sealed_tokens(found, self._sealer)
        self.num_dropped_on_open = len(found.dropped)
        with self._write_lock:
            self._commit_index("recovery", deletes=found.dropped)  # on failure: pending, not admitting
        if stored_paths != paths:  # after the deletes: records left name the same files in both lists
            try:
                db.set_files(paths)
            except lmdb.Error as error:
                self._stop_admitting(error, "recovery")
        self._index.restore(found.restored, found.stored_s)
        for slot, checksum in found.checksums.items():
            self._checksums[slot] = checksum
        self.num_recovered = len(found.restored)
        log.info("SSD tier: %d slots of %d bytes in %d file(s), o_direct=%s; recovered %d blocks, dropped %d",
                 self.num_slots, self.stride, len(paths), self._files.o_direct, self.num_recovered,
                 self.num_dropped_on_open)

    # ------------------------------------------------------------------------------ queries

    def lookup(self, hashes: Sequence[DaemonKey], parent: DaemonKey | None = None,
               token_bytes: TokenBytes | None = None, block_size: int = 0) -> int:
        """How many leading blocks are here (verified against parent and tokens when given)."""
        with self._operation():
            return self._index.lookup(hashes, parent, token_bytes, block_size)

    def holds(self, block_hash: DaemonKey) -> bool:
        """Is the block here, stored or being stored?"""
        return self._index.holds(block_hash)

    def block_hashes(self) -> list[DaemonKey]:  # every block held and visible: recovery checks, evict, tests
        return [e.block_hash for e in self._index.entries() if not e.storing]

    def metas(self, hashes: Sequence[DaemonKey]) -> list[BlockMeta]:
        """The stored keys (hash, parent, token ids) of the leading held blocks named."""
        return self._index.metas(hashes)

    def enable_events(self, max_pending: int, doorbell: Doorbell | None = None) -> None:
        """Queue stored/removed events (SlotIndex.enable_events), for the KV event feed."""
        self._index.enable_events(max_pending, doorbell)

    def take_events(self) -> list[IndexEvent]:
        return self._index.take_events()

    def set_owner_quota(self, owner_of: Callable[[DaemonKey], bytes],
                        limit_bytes: Callable[[bytes], int | None]) -> None:
        """Per-owner byte limits (None = none), enforced in slots; see SlotIndex.set_owner_quota."""
        self._index.set_owner_quota(owner_of, lambda owner: slots_within(limit_bytes(owner), self.stride))

    def set_eviction(self, name: str) -> None:
        """Blocks without a live hint leave in the order called `name` (SlotIndex.set_eviction)."""
        self._index.set_eviction(name)

    def set_retention(self, retention: TierRetention) -> None:
        """Evict by retention class, then LRU (index/classed_lru.py)."""
        self._index.set_retention(retention)

    def reclassify(self, block_hashes: Sequence[DaemonKey]) -> None:
        """The retention hints of these blocks changed (a HintTable listener)."""
        self._index.reclassify(block_hashes)

    def stats(self) -> SsdStats:
        share = self._budget.share(self._budget_key)
        with self._stats_lock:
            return SsdStats(
                capacity_bytes=self.num_slots * self.stride, requested_capacity_bytes=self.config.capacity_bytes,
                used_bytes=self._index.num_used_slots * self.stride, num_cached_blocks=self._index.num_ready,
                num_slots=self.num_slots, slot_nbytes=self.slot_nbytes, num_evictions=self._index.num_evictions,
                num_quota_skips=self._index.num_quota_skips, num_corrupted_blocks=self.drops.num_corrupted,
                num_io_errors=self.drops.num_io_errors, num_recovered_blocks=self.num_recovered,
                num_dropped_on_open=self.num_dropped_on_open, admitting=self._admitting, reason=self._reason or "",
                bytes_written=self.bytes_written, bytes_read=self.bytes_read, o_direct=self._files.o_direct,
                durability=self.config.durability, file_bytes=self._index.num_slots * self.stride,
                share_bytes=share.share_bytes, node_capacity_bytes=share.node_capacity_bytes,
                node_used_bytes=share.node_used_bytes, num_full_skips=self.num_full_skips,
                num_unauthentic_blocks=self.drops.num_unauthentic, sealed=self.record_nbytes != self.slot_nbytes,
                num_aged_out_blocks=self.drops.num_aged_out)

    @property
    def admitting(self) -> bool:
        return self._admitting

    # ------------------------------------------------------------------------------ stores

    def store(self, items: Sequence[tuple[BlockMeta, BlockBytes]]) -> int:
        """Store blocks not already here; returns how many were stored (0 when not admitting or
        on a write error, which stops admission). Raises only for malformed items. The slot
        index's two phases run inside this call, each committing LMDB in the order (a)-(e) above
        (T1's caller, offload.py, runs them itself). Blocking: a spill thread's."""
        metas, sources = checked_blocks(items, self.slot_nbytes)
        with self._operation():
            if not self._admitting or not metas:
                return 0
            self._growth.make_room(sum(1 for block_hash in sources if not self._index.holds(block_hash)))
            with self._write_lock:
                num_new = sum(1 for block_hash in sources if not self._index.holds(block_hash))
                num_quota_skips = self._index.num_quota_skips
                plan = self._index.prepare_store(metas)
                num_full = num_new - len(plan.stores) - (self._index.num_quota_skips - num_quota_skips)
                if num_full > 0:
                    with self._stats_lock:
                        self.num_full_skips += num_full
                victims = plan.evicted + self._growth.watermark_victims(self.config)
                if not self._commit_index("evict", deletes=[v.block_hash for v in victims]):  # (a)
                    self._index.complete_store(plan.stores, False)
                    return 0
            if not plan.stores:
                return 0
            entries = plan.stores
            try:
                checksums = self._io.write(entries, [sources[e.block_hash] for e in entries])  # (b)
                if self.config.durability == "fdatasync":
                    self._files.sync([self._files.location(e.slot)[0] for e in entries])  # (c)
            except BaseException as error:  # the slots go back free; an OSError stops admission
                self._index.complete_store(entries, False)
                if not isinstance(error, OSError):
                    raise
                self._stop_admitting(error, "slot write")
                return 0
            records = [self._record(e, checksum) for e, checksum in zip(entries, checksums)]
            with self._write_lock:
                with self._stats_lock:
                    touched, self._touched = self._touched, {}
                committed = self._commit_index("index commit", puts=records, last_uses=touched)  # (d)
            if committed:
                for entry, checksum in zip(entries, checksums):
                    self._checksums[entry.slot] = checksum
            self._index.complete_store(entries, committed)  # (e)
            if not committed:
                return 0
            with self._stats_lock:
                self.bytes_written += len(entries) * self.slot_nbytes
            return len(entries)

    def _shed(self, nbytes: int) -> int:
        """The budget's call when another layout needs disk: SsdGrowth.shed, unless closed."""
        try:
            with self._operation():
                return self._growth.shed(nbytes)
        except FailedPrecondition:  # closed (_operation); nothing inside raises it
            return 0

    def _record(self, entry: SlotEntry, checksum: int, slot: int | None = None) -> Record:
        """The LMDB record of `entry` at its slot (or at `slot`, where a give-back moves it)."""
        file_index, local_slot = self._files.location(entry.slot if slot is None else slot)
        token_ids = entry.meta.token_ids
        if self._sealer is not None:  # the prompt's tokens: never in the index in the clear
            token_ids = TokenBytes(self._sealer.seal_tokens(entry.block_hash, token_ids))
        return Record(entry.block_hash, file_index, local_slot, self.record_nbytes, checksum, self._layout_id,
                      entry.last_use_s, entry.meta.parent_hash, token_ids, entry.stored_s)

    # ------------------------------------------------------------------------------ loads

    def load(self, hashes: Sequence[DaemonKey], out: torch.Tensor | Sequence[torch.Tensor],
             parent: DaemonKey | None = None, token_bytes: TokenBytes | None = None, block_size: int = 0) -> int:
        """Copy the leading verified hits into out[:k]; returns k. A block failing its read or check
        ends the prefix, is dropped and counted; its row is zeroed. `out`: uint8 `[>= n, slot_nbytes]`
        or n rows (T1 slots: a 4 KiB aligned row one stride long is read into without staging)."""
        rows = checked_rows(out, len(hashes), self.slot_nbytes)
        with self._operation():
            entries = self._index.prepare_load(hashes, parent, token_bytes, block_size)
            if not entries:
                return 0
            fresh = entries[:self.drops.age_limit.num_fresh(entries)]  # a block past the age limit ends the prefix
            try:
                destinations = [rows[i].numpy().data for i in range(len(fresh))]
                results = self._io.read(fresh, destinations) if fresh else []
            finally:
                self._index.unpin(entries)
            if len(fresh) < len(entries):
                self.drops.drop_aged()
            num_loaded = next((i for i, ok in enumerate(results) if ok is not True), len(results))
            self.drops.drop([(e, why) for e, why in zip(entries, results) if why is not True])
            with self._stats_lock:
                self.bytes_read += num_loaded * self.slot_nbytes
                for entry in entries[:num_loaded]:
                    self._touched[entry.block_hash] = entry.last_use_s
            return num_loaded

    # ------------------------------------------------------------------------------ removal, close

    def remove(self, hashes: Sequence[DaemonKey]) -> int:
        """Drop the named blocks that no load pins; returns how many went."""
        with self._operation(), self._write_lock:
            removed = self._index.remove(hashes)
            self._commit_index("remove", deletes=[e.block_hash for e in removed])
            return len(removed)

    def close(self) -> None:
        """Finish in-flight calls, persist last uses, flush the index. Idempotent."""
        with self._state:
            if self._closed:
                return
            self._closed = True
            self._state.wait_for(lambda: self._num_in_flight == 0)
        self._io.close()
        if self._db is not None:
            with self._write_lock:
                self._commit_index("close", last_uses=self._touched)
            with contextlib.suppress(lmdb.Error, OSError):
                self._db.sync()
            self._db.close()
        paths = [f.path for f in self._files.files if f.fd >= 0]
        self._files.close()
        # the files stay on disk: their bytes stay taken, given back first when another layout needs them
        self._budget.make_dormant(self._budget_key, truncating_shed(self._budget, self._budget_key, paths))
        self._lock.release()

    # ------------------------------------------------------------------------------ helpers

    @contextlib.contextmanager
    def _operation(self):
        with self._state:
            if self._closed:
                raise FailedPrecondition("the SSD tier is closed")
            self._num_in_flight += 1
        try:
            yield
        finally:
            with self._state:
                self._num_in_flight -= 1
                self._state.notify_all()

    def _commit_index(self, where: str, deletes: Iterable[DaemonKey] = (), puts: Sequence[Record] = (),
                      last_uses: Mapping[DaemonKey, float] | None = None) -> bool:
        """One LMDB transaction, pending deletes included; the caller holds _write_lock."""
        deletes = self._pending_deletes.union(deletes)
        if not deletes and not puts and not last_uses:
            return True
        if self._db is None:
            return False
        try:
            self._db.commit(deletes, puts, last_uses)
        except (lmdb.Error, OSError) as error:
            self._pending_deletes = deletes | {r.block_hash for r in puts}  # a failed commit may have landed
            self._stop_admitting(error, where)
            return False
        self._pending_deletes = set()
        return True

    def _stop_admitting(self, error: BaseException, where: str) -> None:
        self.drops.count_io_error()
        with self._stats_lock:
            was_admitting, self._admitting = self._admitting, False
            if was_admitting:
                self._reason = describe_error(error, where, self.config.directories[0]) + "; T2 stopped admitting"
        if was_admitting:
            log.error("SSD tier: %s", self._reason)
