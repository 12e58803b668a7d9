"""The tiers of one namespace behind one interface: acquire, commit, release, fork, lookup.

Builds T0 (device pool + block index), T1 (host tier), T2 (SSD tier, optional) and the copy
engine, and wires the T0 eviction hook to the offloader. Offload (down) is in offload.py,
promotion (up) in promotion.py; this module only composes them.
"""

from __future__ import annotations

import concurrent.futures
import logging

from kvtierd.movers.block_codec import make_codec
from kvtierd.block_hash import BlockHash, pack_token_ids
from kvtierd.index.block_index import BlockIndex
from kvtierd.movers.factory import create_copy_engine
from kvtierd.t0.factory import create_device_pool
from kvtierd.t1.host_tier import HostTier
from kvtierd.index.index_metrics import IndexObserver
from kvtierd.layout import Layout
from kvtierd.tiering.offload import Offloader
from kvtierd.tiering.promotion import Acquisition, Promoter, TierHits
from kvtierd.tiering.tier_config import TierConfig
from kvtierd.tiering.tiering_stats import TieringStats, tiering_stats
from kvtierd.tiering.tiers import Tiers

log = logging.getLogger(__name__)


class TierManager:
    """One namespace's tiers. Thread-safe: the index and slot indexes take their own locks."""

    def __init__(self, layout: Layout, num_device_blocks: int, config: TierConfig = TierConfig(), *,
                 ssd_config=None, device: str = "auto", root: BlockHash | None = None, hash_size: int = 32,
                 observer: IndexObserver | None = None, copy_threads: int = 2,
                 max_pending_events: int = 0) -> None:
        pool = create_device_pool(layout, num_device_blocks, device)
        index = BlockIndex(num_device_blocks, layout.block_size, hash_size=hash_size, root=root,
                           copy_block=pool.copy_block, observer=observer,
                           max_pending_events=max_pending_events)
        host = HostTier(layout, config.host_capacity_bytes, config.host_codec) if config.host_capacity_bytes else None
        ssd = None
        if ssd_config is not None:
            from kvtierd.t2.ssd_tier import SsdTier

            ssd = SsdTier.open(ssd_config, layout, make_codec(config.ssd_codec, layout).slot_nbytes)
        engine_kwargs = {"num_threads": copy_threads} if pool.device.type != "cuda" else {}
        engine = create_copy_engine(str(pool.device), **engine_kwargs)
        self.tiers = Tiers(layout, index, pool, host, ssd, engine, config)
        self.offloader = Offloader(self.tiers)
        self.promoter = Promoter(self.tiers, self.offloader)
        index.on_evict = self.offloader.on_t0_evict

    @property
    def index(self) -> BlockIndex:
        return self.tiers.index

    @property
    def pool(self):
        return self.tiers.pool

    def acquire(self, request_id, block_hashes: list[bytes], num_extra_blocks: int = 0, token_ids=None,
                **kwargs) -> Acquisition:
        """T0 blocks for a request: hits first (promoting T1/T2 hits into them), then fresh ones."""
        return self.promoter.acquire(request_id, block_hashes, num_extra_blocks, token_ids, **kwargs)

    def commit(self, request_id, start_position: int, block_hashes: list[bytes], token_ids,
               parent_hash: bytes) -> int:
        """Commit computed full blocks; under write_through they start their way down at once."""
        token_bytes = pack_token_ids(token_ids)
        num_held = self.tiers.index.commit_blocks(request_id, start_position, block_hashes, token_bytes, parent_hash)
        self.offloader.after_commit(request_id, start_position, block_hashes, token_bytes, parent_hash)
        return num_held

    def release(self, request_id, timeout_s: float = 60.0) -> None:
        """Free a request's blocks, after any promotion into them has finished."""
        ticket = self.promoter.pending(request_id)
        if ticket is not None:
            try:
                ticket.wait(timeout_s)
            except concurrent.futures.TimeoutError:
                log.warning("releasing %r with a promotion still in flight after %.0f s", request_id, timeout_s)
        self.tiers.index.free(request_id)

    def fork(self, parent_id, child_id) -> list[int]:
        return self.tiers.index.fork(parent_id, child_id)

    def lookup(self, block_hashes: list[bytes], token_ids=None, prefetch: bool = False) -> TierHits:
        hits = self.promoter.lookup(block_hashes, token_ids)
        if prefetch and hits.t2:
            self.promoter.prefetch(block_hashes, token_ids)
        return hits

    def drain(self) -> None:
        """Wait until every copy in flight has landed and been finalized."""
        self.tiers.wait_quiet()

    def stats(self) -> TieringStats:
        return tiering_stats(self.tiers)

    def close(self) -> None:
        """Finish in-flight moves, flush the SSD index, release memory."""
        tiers = self.tiers
        self.drain()
        tiers.engine.close()
        tiers.finalizer.shutdown(wait=True)
        if tiers.ssd is not None:
            tiers.ssd.close()
        if tiers.host is not None:
            tiers.host.close()
        tiers.pool.close()
