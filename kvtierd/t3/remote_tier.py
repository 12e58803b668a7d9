"""T3 of one layout: blocks in the shared store, one object per block, verified on every read.

Keys: `<key_prefix>:<layout digest hex>:<tenant tag hex>:<client hash hex>` (bytes). The layout
digest (block_frame.layout_digest) covers the layout and the codec, so daemons with different
layouts never read each other's values; the tenant's tag is in every key, so another tenant's
prefix is a plain miss on every node; no hash tag, so a chain spreads over all the store's slots.

Reads: `probe` counts the chain's leading keys present (EXISTS of its first and last key, one
pipeline per node; chain_probe.py: Lookup, and an Acquire that follows without asking again);
`load` GETs the chain and verifies each value against the block asked for (block_frame.py). The
first value missing, short, of another layout, another chain or with a bad checksum ends the run:
the blocks before it are hits, it and the rest are misses, and a bad value is counted by reason.

Only reachable blocks are promised: a probe's answer ends before the chain's first block whose
store node the daemon knows unreachable (RedisStore.num_reachable: its last call failed or its
breaker is not closed), after the probe's own calls, so a node this probe found dead counts too.
Its first and last keys are asked, not the ones between: a node that died since its last call
(a request's, or the PING every remote.probe_interval_s) and holds only blocks between them is not
known yet; those are promised once, and the load that follows finds them missing (misses) and
marks the node, so that no probe after it promises them.

Hits and misses: a block asked of the store counts once, as a hit or a miss. `load` counts what
it was asked to read (hits: verified and loaded; misses: gone since the probe, refused). A probe
counts the blocks it did not find present as misses — absent, after the chain's first absent
block, or on a node that failed or whose breaker is open — when its caller says the chain is a
query (`count_misses`: a Lookup with num_query_blocks, an Acquire that is not a store's, a Get);
the blocks it did find are counted by the load that follows, or not at all when nothing loads
them (a Lookup that is not followed by an Acquire, a hit skipped as slower than recompute).

Writes go through RemoteWrites (bounded; dropped beyond the backlog). Capacity and eviction are
the store's (maxmemory + an allkeys-* policy); a key the store dropped is a miss. A value expires
`ttl_ms` after its write (the store's own expiry, SET PX): the smaller of remote.ttl_s and
retention.max_age_s where set; the store then drops it, a miss like any other.

Sealed (`sealing`, [encryption] on): every value is its frame sealed under its tenant's shared key
(sealed_values.py), on the writer's thread; a load GETs the chain's tenant key record beside its
blocks and opens each value before it verifies the frame, and a value that does not open is
refused ("unauthentic"); a probe asks for the record in its first round trip and answers 0 for a
chain whose tenant has none (forgotten, or never written).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import threading
from collections.abc import Sequence

import torch

from kvtierd.daemon_key import TAG_BYTES, DaemonKey, TenantTag, tenant_tag_of
from kvtierd.index.slot_entry import BlockMeta
from kvtierd.layout import Layout
from kvtierd.movers.copy_engine import Bandwidth
from kvtierd.t3.block_frame import FrameMismatch, FrameValue, frame_value, layout_digest, read_frame
from kvtierd.t3.chain_probe import AlsoAsked, RecentProbes, probe_chains
from kvtierd.t3.redis_store import RedisStore
from kvtierd.t3.remote_writes import RemoteWrites
from kvtierd.t3.sealed_values import ValueSealing
from kvtierd.token_bytes import TokenBytes, block_tokens

MAX_KNOWN_KEYS = 1 << 16  # keys recently written or read: not written again
READ_THREADS = 4  # this layout's T3 reads in flight at once, on threads of their own


@dataclasses.dataclass(frozen=True, slots=True)
class RemoteTierStats:
    """One layout's T3 traffic since start (the store-wide breaker state is RedisStore.health)."""

    codec: str
    num_hit_blocks: int  # blocks read, verified and loaded
    num_miss_blocks: int  # blocks of a query not loaded: absent, on a failed node, gone, refused (module doc)
    num_corrupt_blocks: int  # values found but refused: the frame check, or sealed ones that did not open
    corrupt_reasons: dict[str, int]
    num_unauthentic_blocks: int  # of those, sealed values that did not open as their key's ("unauthentic")
    num_written_blocks: int
    num_failed_writes: int  # frames the store did not take
    num_dropped_writes: int  # frames dropped because the write backlog was full
    read_bytes: int
    written_bytes: int
    write_backlog_bytes: int
    read_bytes_per_s: float
    write_bytes_per_s: float


class RemoteTier:
    def __init__(self, store: RedisStore, layout: Layout, codec_name: str, slot_nbytes: int,
                 sealing: ValueSealing | None = None, max_age_s: float = 0.0) -> None:
        """`sealing`: values sealed per tenant ([encryption] on); `max_age_s`: retention.max_age_s (0: none)."""
        config = store.config
        self.store = store
        self.codec_name = codec_name
        self.slot_nbytes = slot_nbytes
        self.digest = layout_digest(layout, codec_name)
        self._key_head = f"{config.key_prefix}:{self.digest.hex()}:".encode()
        self.ttl_ms = config.value_ttl_ms(max_age_s)
        self.sealing = sealing
        self.read = Bandwidth(0.5e9)  # measured GETs, for cost-aware hits
        self.write = Bandwidth(0.5e9)
        self._lock = threading.Lock()
        self._known: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self._key_of: dict[DaemonKey, bytes] = {}  # daemon key -> store key, for the probes of hot prefixes
        self._counts = collections.Counter()
        self._corrupt = collections.Counter()
        self._recent = RecentProbes()  # the last probes' answers, for the Acquires that follow
        # T3 reads wait on the network: on threads of their own, so that a slow store node never
        # holds the copy engine's T1 and T2 loads
        self.readers = concurrent.futures.ThreadPoolExecutor(READ_THREADS, thread_name_prefix="kvtierd-t3-read")
        self.writes = RemoteWrites(self._write, config.max_write_backlog_bytes, self._written,
                                   on_dropped=self._dropped)

    def key(self, block_hash: DaemonKey) -> bytes:
        """The store key of a daemon key (tenant tag + client hash)."""
        key = self._key_of.get(block_hash)
        if key is None:
            digits = block_hash.hex()
            key = self._key_head + (digits[:2 * TAG_BYTES] + ":" + digits[2 * TAG_BYTES:]).encode()
            if len(self._key_of) >= MAX_KNOWN_KEYS:  # a cache: emptied when full, never grown past it
                self._key_of.clear()
            self._key_of[block_hash] = key
        return key

    # ----------------------------------------------------------------------------- reads

    def probe(self, block_hashes: Sequence[DaemonKey], count_misses: bool = False, reuse: bool = False) -> int:
        """How many leading blocks of the chain the store holds, as chain_probe.py asks (the first
        and last key; the rest only when the last is absent); not verified until `load`.
        `count_misses`: the chain is a query; the blocks after those are misses (module doc).
        `reuse`: take a Lookup's answer for this very chain from the last PROBE_ANSWER_TTL_S
        instead of asking again (an Acquire after its Lookup)."""
        answer = self._recent.take(block_hashes) if reuse else None
        if answer is None:
            return self.probe_chains([block_hashes], count_misses)[0]
        if count_misses and not answer.misses_counted:
            with self._lock:
                self._counts["miss"] += answer.num_blocks - answer.num_present
        return answer.num_present

    def probe_chains(self, chains: Sequence[Sequence[DaemonKey]], count_misses: bool = False) -> list[int]:
        """`probe` of each chain, every chain's keys asked at once (one or two round trips), each
        answer ending before its first block on a node known unreachable (module doc)."""
        exists = self.store.exists
        tags = _tags_of(chain[0] for chain in chains if chain) if self.sealing is not None else []
        if self.sealing is not None:
            exists = AlsoAsked(exists, self.sealing.record_keys(tags))
        leading = probe_chains(chains, self.key, exists)
        if isinstance(exists, AlsoAsked) and exists.extra_present is not None:  # no key record: nothing opens
            keyed = {tag for tag, present in zip(tags, exists.extra_present) if present}
            leading = [n if n and tenant_tag_of(chain[0]) in keyed else 0 for chain, n in zip(chains, leading)]
        if not self.store.all_reachable():
            leading = [self.store.num_reachable([self.key(h) for h in chain[:n]]) if n > 1 else n
                       for chain, n in zip(chains, leading)]
        for chain, num_present in zip(chains, leading):
            if chain:
                self._recent.remember(chain, num_present, count_misses)
        if count_misses:
            with self._lock:
                self._counts["miss"] += sum(len(chain) for chain in chains) - sum(leading)
        return leading

    def load(self, block_hashes: Sequence[DaemonKey], parent: DaemonKey | None, token_bytes: TokenBytes | None,
             block_size: int, counted: bool = True) -> tuple[list[BlockMeta], list[memoryview]]:
        """GET the chain's blocks (one pipeline per node) and verify them in order: the metas of
        the leading blocks that passed (token ids from their frames) and views of their payloads
        (each view's `.obj` is the whole value read). `parent`: the first block's parent; None
        when the caller does not know it (a chain's first block: the index has no fixed root),
        which then comes from the frame. `counted` False: the caller counts the hits and misses
        (`count_reads`), e.g. a read ahead that its caller may not use."""
        if not block_hashes:
            return [], []
        keys = [self.key(h) for h in block_hashes]
        tags = _tags_of(block_hashes) if self.sealing is not None else []
        record_keys = self.sealing.record_keys(tags) if self.sealing is not None else []
        with self.read.measure(len(block_hashes) * self.slot_nbytes):
            values = self.store.get(keys + record_keys)  # a sealed chain's key records in the same round trip
        opener = self.sealing.opener(tags, values[len(keys):]) if self.sealing is not None else None
        values = values[:len(keys)]
        metas: list[BlockMeta] = []
        payloads: list[memoryview] = []
        num_read_bytes = 0
        for i, block_hash in enumerate(block_hashes):
            value, values[i] = values[i], None  # sealed, the value read is dropped once opened: one chain's peak
            if value is None:
                break
            value_nbytes = len(value)
            if self.sealing is not None and opener is not None:
                value = self.sealing.open(opener, block_hash, value)
                if value is None:
                    self._refused(block_hash, "unauthentic")
                    break
            tokens = block_tokens(token_bytes, i, block_size)
            try:
                frame = read_frame(value, self.digest, block_hash, parent, self.slot_nbytes, tokens,
                                   authenticated=self.sealing is not None)
            except FrameMismatch as e:
                self._refused(block_hash, e.reason)
                break
            metas.append(BlockMeta(block_hash, frame.parent_hash, frame.token_ids))
            payloads.append(frame.payload)
            num_read_bytes += value_nbytes
            parent = block_hash
        with self._lock:
            for key in keys[:len(metas)]:
                self._remember(key)
        if counted:
            self.count_reads(len(metas), len(block_hashes) - len(metas), num_read_bytes)
        return metas, payloads

    def count_reads(self, num_hit_blocks: int, num_miss_blocks: int, num_read_bytes: int) -> None:
        """Count blocks a query read (hits: verified and used) or did not get (misses)."""
        with self._lock:
            self._counts["hit"] += num_hit_blocks
            self._counts["miss"] += num_miss_blocks
            self._counts["read_bytes"] += num_read_bytes

    # ----------------------------------------------------------------------------- writes

    def offer(self, metas: Sequence[BlockMeta], rows: torch.Tensor | Sequence, copy: bool = True) -> int:
        """Frame the blocks and queue their writes; returns how many were queued. `rows`: a uint8
        tensor of one row per block, or one 1-D uint8 view per block (e.g. of T1 slots), copied
        so the caller may reuse them at once; with `copy` False, buffers of the payloads (e.g. a
        Put's received bytes) that stay unchanged until written. Blocks written recently, or
        queued, are skipped."""
        assert len(rows) == len(metas)
        with self._lock:
            fresh = [(i, m, self.key(m.block_hash)) for i, m in enumerate(metas)]
            fresh = [(i, m, key) for i, m, key in fresh if key not in self._known]
            for _, _, key in fresh:  # queued: not offered again (forgotten if dropped or failed)
                self._remember(key)
        items = []
        for i, meta, key in fresh:
            row = rows[i]
            payload = row.numpy().data if isinstance(row, torch.Tensor) else memoryview(row).cast("B")
            assert payload.nbytes == self.slot_nbytes
            items.append((key, frame_value(self.digest, meta.block_hash, meta.parent_hash, meta.token_ids,
                                           bytes(payload) if copy else payload)))
        return self.writes.offer(items)

    def _write(self, items: list[tuple[bytes, FrameValue]]) -> list[bool]:
        """On the writer's thread: SET the batch, each value sealed first when sealing is on (a
        value whose tenant has no key this node can use is not written)."""
        if self.sealing is None:
            with self.write.measure(sum(len(frame) for _, frame in items)):
                return self.store.set(items, self.ttl_ms)
        sealed = self.sealing.seal(items)
        ready = [(key, value) for (key, _), value in zip(items, sealed) if value is not None]
        with self.write.measure(sum(len(value) for _, value in ready)):
            written = iter(self.store.set(ready, self.ttl_ms))
        return [value is not None and next(written) for value in sealed]

    def _written(self, items: list[tuple[bytes, FrameValue]], written: list[bool]) -> None:
        with self._lock:
            for (key, frame), ok in zip(items, written):
                if ok:
                    self._counts["written"] += 1
                    self._counts["written_bytes"] += len(frame)
                else:
                    self._known.pop(key, None)  # may be offered again
                    self._counts["failed_writes"] += 1

    def _dropped(self, keys: list[bytes]) -> None:
        with self._lock:
            for key in keys:
                self._known.pop(key, None)

    def forget_tenant(self, tag: TenantTag) -> int:
        """After the tenant's key was destroyed: its queued writes dropped (sealed after that, they
        would be written under a new key) and its blocks no longer taken as written, so that its
        next blocks go to the store again, under its new key. Returns how many writes were dropped."""
        head = self._key_head + tag.hex().encode() + b":"
        with self._lock:
            for key in [key for key in self._known if key.startswith(head)]:
                del self._known[key]
        return self.writes.discard(lambda key: key.startswith(head))

    def _remember(self, key: bytes) -> None:
        """Under _lock."""
        self._known[key] = None
        self._known.move_to_end(key)
        if len(self._known) > MAX_KNOWN_KEYS:
            self._known.popitem(last=False)

    def _refused(self, block_hash: DaemonKey, reason: str) -> None:
        with self._lock:
            self._corrupt[reason] += 1
            self._known.pop(self.key(block_hash), None)  # ours may be written again

    # ----------------------------------------------------------------------------- state

    def stats(self) -> RemoteTierStats:
        with self._lock:
            counts, corrupt = dict(self._counts), dict(self._corrupt)
        return RemoteTierStats(
            codec=self.codec_name, num_hit_blocks=counts.get("hit", 0), num_miss_blocks=counts.get("miss", 0),
            num_corrupt_blocks=sum(corrupt.values()), corrupt_reasons=corrupt,
            num_unauthentic_blocks=corrupt.get("unauthentic", 0),
            num_written_blocks=counts.get("written", 0), num_failed_writes=counts.get("failed_writes", 0),
            num_dropped_writes=self.writes.num_dropped, read_bytes=counts.get("read_bytes", 0),
            written_bytes=counts.get("written_bytes", 0), write_backlog_bytes=self.writes.backlog_bytes,
            read_bytes_per_s=self.read.bytes_per_s, write_bytes_per_s=self.write.bytes_per_s)

    def drain(self, timeout_s: float | None = None) -> bool:
        """Until every queued write went out (or failed)."""
        return self.writes.wait_idle(timeout_s)

    def close(self) -> None:
        self.readers.shutdown(wait=True)
        self.writes.close()


def _tags_of(block_hashes) -> list[TenantTag]:
    """The distinct tenants of some daemon keys, in order (a chain is one tenant's)."""
    return list(dict.fromkeys(map(tenant_tag_of, block_hashes)))
