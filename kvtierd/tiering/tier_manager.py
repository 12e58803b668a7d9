"""The tiers of one namespace behind one interface: acquire, commit, release, fork, lookup,
and the Put and Get use cases (block_io.py).

Builds T0 (device pool + block index), T1 (host tier), T2 (SSD tier, optional), T3 (this
layout's part of the node's shared store, optional) and the copy engine, and wires the T0
eviction hook to the offloader. Offload (down) is in offload.py, promotion (up) in promotion.py
(T2 and T3 reads in lower_reads.py); this module only composes them.

No method waits on a copy or a disk, except where it says so (release behind a promotion,
prepare_write behind a write-back, Put's writes, close): the daemon calls those off its loop.
With T3 (`has_remote`), `lookup`, `lookup_chains` and `acquire` ask the store too (a network
round trip, bounded by its timeout and breaker): the daemon calls them off its loop then.
Blocks a call hands out may still be having their evicted bytes copied down: such calls return
a `writable` future, and the caller lets nobody write the blocks before it resolves.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvtierd.chain_lookup import ChainLookup
from kvtierd.daemon_key import DaemonKey
from kvtierd.index.allocation import WriteTarget
from kvtierd.index.block_index import BlockIndex, RequestId
from kvtierd.index.index_metrics import IndexObserver
from kvtierd.index.query_counting import QueryCounting
from kvtierd.layout import Layout
from kvtierd.movers.block_codec import make_codec
from kvtierd.movers.factory import CopyEngines
from kvtierd.t0.device_pool import DevicePool
from kvtierd.t0.factory import create_device_pool
from kvtierd.t1.host_tier import HostTier
from kvtierd.t2.node_budget import NodeBudget
from kvtierd.tier import Tier, TierCounts
from kvtierd.tiering.block_io import Admit, BlockGet, BlockPut
from kvtierd.tiering.layout_tiers import Tiers
from kvtierd.tiering.leave_reasons import attach_leave_reasons
from kvtierd.tiering.lookup_holds import HoldKey, LookupHolds
from kvtierd.tiering.offload import Offloader
from kvtierd.tiering.promotion import AcquiredBlocks, Promoter
from kvtierd.tiering.retention_hints import LayoutRetention
from kvtierd.tiering.tier_config import LAYOUT_COST, LayoutCost, TierConfig
from kvtierd.tiering.tiering_stats import TieringStats, tiering_stats
from kvtierd.tiering.write_backs import WriteBacks
from kvtierd.token_bytes import PackableTokenIds, TokenBytes, pack_optional, pack_token_ids

if TYPE_CHECKING:  # imported when built (below): lmdb and redis load only for a pool that has T2 or T3
    from kvtierd.sealing.shared_tenant_keys import SharedTenantKeys
    from kvtierd.t2.ssd_config import SsdTierConfig
    from kvtierd.t3.redis_store import RedisStore

log = logging.getLogger(__name__)


class TierManager:
    """One namespace's tiers. Thread-safe: the index and slot indexes take their own locks."""

    def __init__(self, layout: Layout, num_device_blocks: int, config: TierConfig = TierConfig(), *,
                 ssd_config: SsdTierConfig | None = None, device: str = "auto", root: DaemonKey | None = None,
                 hash_size: int = 32, observer: IndexObserver | None = None, copy_threads: int = 2,
                 max_pending_events: int = 0, engines: CopyEngines | None = None,
                 remote_store: RedisStore | None = None, cuda_share: str = "fd",
                 host_budget: NodeBudget | None = None, host_key: str = "",
                 remote_keys: SharedTenantKeys | None = None) -> None:
        """`engines`: the node's copy engines, one per device, shared with the other layouts on it
        (None: a private set, of `copy_threads` threads without CUDA). `remote_store`: the node's
        shared store (None: no T3); `remote_keys`: the tenants' shared data keys its values are
        sealed with (None: [encryption] off). `cuda_share`: how a CUDA pool is shared ("fd" | "ipc", factory.py).
        `host_budget`: the node's host budget T1 shares with the other layouts, as `host_key` (None: a
        budget of T1's own, `config.host_capacity_bytes`)."""
        config = config.for_layout(layout)
        pool = create_device_pool(layout, num_device_blocks, device, cuda_share="ipc" if cuda_share == "ipc" else "fd")
        write_backs = WriteBacks()

        def copy_block(src_block_id: int, dst_block_id: int) -> None:
            """Copy-on-write under the index lock: into a block just evicted, after its old bytes
            have been copied down (a T0 → T1 copy, never a disk write: T2 spills come later)."""
            landed = write_backs.when_landed([dst_block_id])
            if landed is not None:
                landed.result()
            pool.copy_block(src_block_id, dst_block_id)

        index = BlockIndex(num_device_blocks, layout.block_size, hash_size=hash_size, root=root,
                           copy_block=copy_block, observer=observer,
                           max_pending_events=max_pending_events)
        host = None
        if config.host_capacity_bytes:
            host = HostTier(layout, config.host_capacity_bytes, config.host_codec, budget=host_budget,
                            key=host_key or layout.model_id, idle_s=config.host_idle_s)
        ssd = None
        if ssd_config is not None:
            from kvtierd.t2.ssd_tier import SsdTier

            ssd = SsdTier.open(ssd_config, layout, make_codec(config.ssd_codec, layout).slot_nbytes, config.ssd_codec)
        remote = None
        if remote_store is not None:
            from kvtierd.t3.remote_tier import RemoteTier
            from kvtierd.t3.sealed_values import ValueSealing

            sealing = None
            if remote_keys is not None:
                sealing = ValueSealing(remote_keys, layout.fingerprint(), config.remote_codec)
            remote = RemoteTier(remote_store, layout, config.remote_codec,
                                make_codec(config.remote_codec, layout).slot_nbytes, sealing,
                                config.retention.max_age_s)
        index.set_eviction(config.t0_eviction)  # the order of blocks without a live hint, per tier
        if host is not None:
            host.index.set_eviction(config.t1_eviction)
        if ssd is not None:
            ssd.set_eviction(config.t2_eviction)
        self._closed = False
        self._engines = engines if engines is not None else CopyEngines(num_cpu_threads=copy_threads)
        engine = self._engines.acquire(str(pool.device))
        self.tiers = Tiers(layout, index, pool, host, ssd, engine, config, write_backs=write_backs, remote=remote)
        self.offloader = Offloader(self.tiers)
        self.promoter = Promoter(self.tiers, self.offloader)
        self.offloader.connect(self.promoter.levels)  # the edges out of T1 and T2 offer to the tiers below
        index.on_evict = self.offloader.on_t0_evict
        attach_leave_reasons(self.tiers)  # why blocks leave each tier: evicted, demoted or expired
        self.retention = LayoutRetention(self.tiers)  # hints: eviction classes in T0, T1, T2, and their quotas
        self.lookup_holds = LookupHolds(index, self.promoter, lambda: host.index.num_slots if host is not None else 0)

    @property
    def index(self) -> BlockIndex:
        return self.tiers.index

    @property
    def device_pool(self) -> DevicePool:
        return self.tiers.pool

    @property
    def has_remote(self) -> bool:
        """Does this layout have T3 (so `lookup` and `acquire` may wait on the network)?"""
        return self.tiers.remote is not None

    def acquire(self, request_id: RequestId, block_hashes: list[DaemonKey], num_extra_blocks: int = 0,
                token_ids: PackableTokenIds | None = None,
                recompute_s_per_token: float | None | LayoutCost = LAYOUT_COST, num_t3_present: int | None = None,
                counting: QueryCounting = QueryCounting.QUERY_AND_HITS) -> AcquiredBlocks:
        """T0 blocks for a request: hits first (promoting T1/T2/T3 hits into them), then fresh ones.
        `recompute_s_per_token`: the cost a lower-tier hit must beat to be loaded (load_decision.py;
        default the layout's, None: load every hit); `num_t3_present` and `counting`: Promoter.acquire's."""
        return self.promoter.acquire(request_id, block_hashes, num_extra_blocks, token_ids,
                                     recompute_s_per_token=recompute_s_per_token, num_t3_present=num_t3_present,
                                     counting=counting)

    def hold_promise(self, key: HoldKey, block_hashes: list[DaemonKey], token_ids: PackableTokenIds | None,
                     hits: TierCounts, declined: TierCounts) -> TierCounts:
        """Hold what a Lookup of the chain promised (its `hits` less the `declined`) in T0 and T1
        until an Acquire names `key` (release_promise) or it lapses (lookup_holds.py)."""
        promised = hits.first(hits.num_blocks - declined.num_blocks)
        return self.lookup_holds.hold(key, block_hashes, pack_optional(token_ids), promised)

    def release_promise(self, key: HoldKey) -> bool:
        return self.lookup_holds.release(key)

    def commit(self, request_id: RequestId, start_position: int, block_hashes: list[DaemonKey],
               token_ids: PackableTokenIds, parent_hash: DaemonKey) -> int:
        """Commit computed full blocks; under write_through they start their way down at once."""
        token_bytes = pack_token_ids(token_ids)
        num_held = self.tiers.index.commit_blocks(request_id, start_position, block_hashes, token_bytes, parent_hash)
        self.offloader.after_commit(request_id, start_position, block_hashes, token_bytes, parent_hash)
        return num_held

    def release(self, request_id: RequestId, timeout_s: float = 60.0) -> None:
        """Free a request's blocks, after any promotion into them has finished."""
        ticket = self.promoter.pending(request_id)
        if ticket is not None:
            try:
                ticket.wait(timeout_s)
            except concurrent.futures.TimeoutError:
                log.warning("releasing %r with a promotion still in flight after %.0f s", request_id, timeout_s)
        self.tiers.index.free(request_id)

    def fork(self, parent_id: RequestId, child_id: RequestId) -> list[int]:
        return self.tiers.index.fork(parent_id, child_id)

    def block_table(self, request_id: RequestId) -> list[int]:
        return self.tiers.index.block_table(request_id)

    def num_committed_blocks(self, request_id: RequestId) -> int:
        """How many leading blocks of the request's table are committed (ready to read)."""
        blocks = self.tiers.index.blocks
        table = self.tiers.index.block_table(request_id)
        return next((i for i, block_id in enumerate(table) if blocks[block_id].block_hash is None), len(table))

    def append_blocks(self, request_id: RequestId,
                      num_blocks: int) -> tuple[list[int], concurrent.futures.Future[None] | None]:
        """Fresh blocks at the end of a request's table, and when they may be written (None: now)."""
        block_ids = self.tiers.index.append_blocks(request_id, num_blocks)
        return block_ids, self.tiers.write_backs.when_landed(block_ids)

    def prepare_write(self, request_id: RequestId, position: int) -> WriteTarget:
        """The block a request may write at `position` (copy-on-write; may wait for a write-back)."""
        return self.tiers.index.prepare_write(request_id, position)

    def start_put(self, request_id: RequestId, parent: DaemonKey) -> BlockPut:
        """A Put of blocks after `parent` (the key before the first), into a private request."""
        return BlockPut(self.tiers, self.offloader, request_id, parent, self.commit)

    def start_get(self, request_id: RequestId, keys: list[DaemonKey], token_ids: PackableTokenIds | None = None,
                  admit: Admit = lambda num_blocks: None) -> BlockGet:
        """A Get of the chain's leading blocks from any tier, promoted into a private request."""
        return BlockGet.start(self.tiers, self.promoter, self.release, request_id, keys,
                              pack_optional(token_ids), admit)

    def report_recompute(self, s_per_token: float) -> None:
        """An engine's measured cost of recomputing a prompt token of this layout (0: none yet;
        recompute_cost.py); a bad value raises InvalidArgument and changes nothing."""
        self.tiers.recompute.report(s_per_token)

    def declined(self, hits: TierCounts) -> TierCounts:
        """Of a lookup's `hits`, the lower-tier blocks an acquire would not load, being slower than
        recomputing them (load_decision.py): the trailing ones."""
        return self.promoter.declined(hits)

    def count_query(self, hits: TierCounts, declined: TierCounts, num_query_blocks: int) -> None:
        """A Lookup's query, counted once (query_counting.py): the chain's first `num_query_blocks`
        blocks; of them, its `hits` (a lookup's, T3's included) up to the `declined` ones count as
        hits tier by tier, the declined as skipped (recomputed), the rest as misses."""
        counters, index = self.tiers.counters, self.tiers.index
        asked = hits.first(num_query_blocks)
        promised = hits.first(hits.num_blocks - declined.num_blocks).first(num_query_blocks)
        counters.count_queries(num_query_blocks)
        for tier, num_blocks in promised.items():
            counters.count_hits(tier, num_blocks)
        counters.count_skipped_slow(asked - promised)
        index.count_query(num_query_blocks * index.block_size, promised.t0 * index.block_size)

    def lookup(self, block_hashes: list[DaemonKey], token_ids: PackableTokenIds | None = None, prefetch: bool = False,
               ask_remote: bool = True, count_misses: bool = False) -> TierCounts:
        """Where the chain's prefix lives. With `ask_remote` False, the local tiers only (never
        waits on the network); with `prefetch`, T2 and T3 hits start their way into T1 (those not
        `declined`); with `count_misses` (the chain is a query), what T3 lacks counts as its misses."""
        hits = self.promoter.lookup(block_hashes, token_ids, ask_remote, count_misses)
        if prefetch and (hits.t2 or hits.t3):
            self.promoter.prefetch(block_hashes, token_ids, hits)
        return hits

    def lookup_chains(self, chains: Sequence[tuple[list[DaemonKey], TokenBytes | None]], *, prefetch: bool = False,
                      num_query_blocks: int = 0, hold: HoldKey | None = None) -> ChainLookup:
        """A whole Lookup of chains of (block hashes, token bytes): the local tiers, then T3 for what
        they lack, every chain in one round trip (with T3 this may wait on the network: call it off
        the event loop then). `prefetch`: each chain's T2 and T3 hits start their way into T1.
        `num_query_blocks`: the first chain's leading blocks are a query, counted once (its T3
        misses too); `hold`: what the first chain promised is held until an Acquire names it."""
        assert chains and num_query_blocks <= len(chains[0][0]), (len(chains), num_query_blocks)
        hits = [self.promoter.lookup(keys, token_bytes, ask_remote=False) for keys, token_bytes in chains]
        rests = [keys[h.num_blocks:] for (keys, _), h in zip(chains, hits)]
        if self.tiers.remote is not None and any(rests):
            found = self.tiers.remote.probe_chains(rests, num_query_blocks > 0)
            hits = [h.replace(Tier.T3, n) if n else h for h, n in zip(hits, found)]
        if prefetch:
            for (keys, token_bytes), h in zip(chains, hits):
                if h.t2 or h.t3:
                    self.promoter.prefetch(keys, token_bytes, h)
        answer = ChainLookup(tuple(hits), tuple(self.declined(h) for h in hits))
        if num_query_blocks:
            self.count_query(answer.hits[0], answer.declined[0], num_query_blocks)
        if hold is not None:
            self.hold_promise(hold, chains[0][0], chains[0][1], answer.hits[0], answer.declined[0])
        return answer

    def drain(self) -> None:
        """Wait until every copy in flight has landed and been finalized, and every T3 write
        queued went out (or failed)."""
        self.tiers.wait_quiet()
        if self.tiers.remote is not None:
            self.tiers.remote.drain()

    def stats(self) -> TieringStats:
        return dataclasses.replace(tiering_stats(self.tiers),
                                   num_retention_downgraded_blocks=self.retention.num_downgraded_blocks)

    def close(self) -> None:
        """Finish in-flight moves, flush the SSD index, release memory. Idempotent."""
        if self._closed:
            return
        self._closed = True
        tiers = self.tiers
        self.lookup_holds.release_all()
        self.drain()
        self._engines.release(tiers.engine)
        tiers.close_threads()
        if tiers.remote is not None:
            tiers.remote.close()
        if tiers.ssd is not None:
            tiers.ssd.close()
        if tiers.host is not None:
            tiers.host.close()
        tiers.pool.close()
