"""The pools the daemon serves: one set of tiers per layout, created on first Attach and shared
by every tenant (keys keep tenants apart, see tenants.py).

Per layout: the T0 device pool, `pool.t0_bytes // bytes_per_block` blocks. Per node: the T1 host
memory (`host_capacity_bytes`) and the T2 disk (`ssd.capacity_bytes`), each one NodeBudget
(t2/node_budget.py) the layouts take from, so that their sum never exceeds the node's budget:
- T1: a layout's host tier takes its fair share (the budget over the layouts with T1) when its pool
  is created, grows past it while it evicts and the budget has bytes free (one layout alone may
  hold all of it), and gives back when a layout below its share asks (its least recently used
  blocks first; t1/host_share.py). `pool.max_layouts` bounds how many layouts attach, no more.
- T2: a layout's slot files (under `<ssd directory>/<layout id>`, so a restarted daemon finds
  each layout's blocks again) grow as blocks are written, by what the budget grants; with the
  budget spent a layout reuses its own least recently used slots, and one under its fair share
  (budget / layouts with T2) makes one above it give back: its least recently used blocks first,
  the kept ones copied out of the end of its files, which are then truncated (t2/ssd_growth.py).
  Slot files a restarted daemon finds count before their layout attaches again (dormant: they
  give back first).

The daemon's keys are `tenant tag + client hash`, so the index runs with
`hash_size = 16 + digest size` and no fixed root: the servicer checks that a chain's first
block names the client root.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvtierd.block_hash import HASH_FUNCTIONS, Namespace
from kvtierd.daemon_key import daemon_key_size, tenant_tag_of
from kvtierd.errors import FailedPrecondition, ResourceExhausted
from kvtierd.layout import Layout
from kvtierd.movers.factory import CopyEngines
from kvtierd.node.pool_config import PoolConfig
from kvtierd.node.quotas import QuotaBook
from kvtierd.planning.capacity import PoolCapacity, layout_lines
from kvtierd.t2.node_budget import BudgetShare, NodeBudget, truncating_shed
from kvtierd.t2.ssd_config import SsdConfig
from kvtierd.t2.ssd_space import SLOT_FILE_NAME, layout_slot_files
from kvtierd.t3.remote_config import RemoteConfig
from kvtierd.tier import Tier
from kvtierd.tiering.tier_config import TierConfig
from kvtierd.tiering.tier_manager import TierManager

if TYPE_CHECKING:  # imported where T3 is on (PoolRegistry): redis loads only then
    from kvtierd.index.index_metrics import IndexObserver
    from kvtierd.sealing.master_key import MasterKey
    from kvtierd.sealing.shared_tenant_keys import SharedTenantKeys
    from kvtierd.sealing.tenant_keys import TenantKeys
    from kvtierd.t3.redis_store import RedisStore

log = logging.getLogger(__name__)

MAX_PENDING_EVENTS = 65536


@dataclasses.dataclass(frozen=True)
class PoolSettings:
    """What every pool is built with: the daemon's sections (serve.py's pool_settings)."""

    pool: PoolConfig  # t0_bytes per layout, device, hash_algo, max_layouts
    tier_config: TierConfig  # its host_capacity_bytes is the node's T1 budget, shared by the layouts
    ssd: SsdConfig | None = None  # None = no T2; its capacity_bytes is the node's T2 budget, shared by the layouts
    remote: RemoteConfig | None = None  # None = no T3; its password already read from the file
    tenant_keys: TenantKeys | None = None  # [encryption] on: T2 values sealed under each tenant's data key
    master_key: MasterKey | None = None  # [encryption] on: wraps T3's shared data keys too (with a T3)
    t2_max_age_s: float = 0.0  # retention.max_age_s: older T2 blocks are misses and reclaimed; 0 = no limit

    @property
    def hash_algo(self) -> str:
        """The hash of the block keys every pool uses (the servicer checks a client's against it)."""
        return self.pool.hash_algo


class LayoutPool:
    """One layout's tiers, and what clients of that layout need to know."""

    def __init__(self, layout: Layout, settings: PoolSettings, observer: IndexObserver | None = None,
                 quotas: QuotaBook | None = None, engines: CopyEngines | None = None,
                 remote_store: RedisStore | None = None, host_budget: NodeBudget | None = None,
                 ssd_budget: NodeBudget | None = None, remote_keys: SharedTenantKeys | None = None) -> None:
        """`host_budget`, `ssd_budget`: the node's (PoolRegistry's); None: this pool's own, of the
        settings' capacities. `remote_keys`: the node's shared data keys (T3 sealed)."""
        pool_config = settings.pool
        num_blocks = pool_config.t0_bytes // layout.bytes_per_block
        if num_blocks < 1:
            raise FailedPrecondition(
                f"a block of this layout is {layout.bytes_per_block:,} bytes: more than the device pool "
                f"budget t0_bytes={pool_config.t0_bytes:,}")
        self.layout = layout
        self.client_root = Namespace(layout, "", pool_config.hash_algo).root
        self.digest_size = HASH_FUNCTIONS[pool_config.hash_algo][0]
        self._key = layout_id(layout)
        self.host_budget = host_budget or NodeBudget(settings.tier_config.host_capacity_bytes, "host")
        ssd_config = None
        self.ssd_budget = None
        if settings.ssd is not None:
            self.ssd_budget = ssd_budget or NodeBudget(settings.ssd.capacity_bytes, "ssd")
            ssd_config = settings.ssd.tier_config(self._key, self.ssd_budget, settings.tenant_keys,
                                                  settings.t2_max_age_s)
        self.manager = TierManager(layout, num_blocks, settings.tier_config, ssd_config=ssd_config,
                                   device=pool_config.device, hash_size=daemon_key_size(self.digest_size),
                                   observer=observer, max_pending_events=MAX_PENDING_EVENTS, engines=engines,
                                   remote_store=remote_store, cuda_share=pool_config.cuda_share,
                                   host_budget=self.host_budget, host_key=self._key, remote_keys=remote_keys)
        tiers = self.manager.tiers
        if quotas is not None and quotas.limits_lower_tiers:
            for tier, store in ((Tier.T1, tiers.host), (Tier.T2, tiers.ssd)):
                if store is not None:
                    store.set_owner_quota(tenant_tag_of, quotas.lower_tier_limit(tier))

    @property
    def num_blocks(self) -> int:
        return self.manager.index.num_blocks

    def capacity_lines(self, request_tokens: int = 8192) -> list[str]:
        tiers = self.manager.tiers
        lines = layout_lines(self.layout)
        lines += PoolCapacity(self.layout, self.num_blocks).lines("T0 device pool", request_tokens)
        for name, num_slots in (("T1 host", tiers.host.index.num_slots if tiers.host else 0),
                                ("T2 SSD", tiers.ssd.num_slots if tiers.ssd else 0)):
            if num_slots:  # slots are 4 KiB aligned: a small block can take more than its bytes
                lines.append(PoolCapacity(self.layout, num_slots).lines(name, request_tokens)[0])
        return lines

    def node_share(self, tier: Tier) -> BudgetShare | None:
        """This layout's part of the node's T1 or T2 budget (None: the tier is absent)."""
        tiers = self.manager.tiers
        if tier == Tier.T1 and tiers.host is not None:
            return self.host_budget.share(self._key)
        if tier == Tier.T2 and tiers.ssd is not None:
            ssd = tiers.ssd.stats()
            return BudgetShare(ssd.file_bytes, ssd.share_bytes, ssd.node_capacity_bytes, ssd.node_used_bytes)
        return None

    def close(self) -> None:
        self.manager.close()


def layout_id(layout: Layout) -> str:
    """A short, stable name for a layout (directory names, labels)."""
    return hashlib.sha256(layout.fingerprint()).hexdigest()[:16]


class PoolRegistry:
    """layout → LayoutPool. `get_or_create` builds a pool once, even under concurrent attaches."""

    def __init__(self, settings: PoolSettings, observer_for: Callable[[str], IndexObserver] | None = None,
                 quotas: QuotaBook | None = None) -> None:
        self.settings = settings
        self.quotas = quotas
        self._observer_for = observer_for  # model_id → IndexObserver, or None
        self._pools: dict[Layout, LayoutPool] = {}
        self._lock = threading.Lock()  # creation only; lookups read the dict
        self.on_created = []  # callbacks (pool) → None, e.g. metrics sources
        self.engines = CopyEngines()  # one copy engine per device, shared by the layouts on it
        self.remote_store = None  # the node's client of the shared store (T3), shared by the layouts
        self.remote_keys = None  # T3's tenant data keys, wrapped in the store ([encryption] on with a T3)
        self.host_budget = NodeBudget(settings.tier_config.host_capacity_bytes, "host")  # T1, per node
        self.ssd_budget = None  # T2, per node: the slot files of every layout, a restarted daemon's included
        if settings.ssd is not None:
            self.ssd_budget = NodeBudget(settings.ssd.capacity_bytes, "ssd")
            for directory, nbytes in layout_slot_files(settings.ssd.directory).items():
                paths = [os.path.join(directory, SLOT_FILE_NAME)]
                self.ssd_budget.add_dormant(directory, nbytes, truncating_shed(self.ssd_budget, directory, paths))
            self.ssd_budget.shed_over_capacity()  # the budget was lowered since they were written
        if settings.remote is not None:
            from kvtierd.t3.redis_store import RedisStore

            self.remote_store = RedisStore(settings.remote)  # connects on first use: starts with the store down
            if settings.master_key is not None:
                from kvtierd.sealing.shared_tenant_keys import SharedTenantKeys
                from kvtierd.t3.key_records import StoreKeyRecords

                self.remote_keys = SharedTenantKeys(settings.master_key, StoreKeyRecords(self.remote_store))

    def get(self, layout: Layout) -> LayoutPool | None:
        return self._pools.get(layout)

    def pools(self) -> list[LayoutPool]:
        return list(self._pools.values())

    def get_stored(self, layout: Layout) -> LayoutPool | None:
        """The layout's pool, created when T2 has a directory for it (after a restart, T2 may hold
        its blocks before any Attach or Put of it) or when there is a shared store (T3 may hold
        blocks another node put). None when neither exists. Blocking (opens T2)."""
        pool = self._pools.get(layout)
        settings = self.settings
        if pool is None and self.remote_store is not None:
            return self.get_or_create(layout)
        if pool is not None or settings.ssd is None:
            return pool
        if not os.path.isdir(os.path.join(settings.ssd.directory, layout_id(layout))):
            return None
        return self.get_or_create(layout)

    def get_or_create(self, layout: Layout) -> LayoutPool:
        pool = self._pools.get(layout)
        if pool is not None:
            return pool
        with self._lock:
            pool = self._pools.get(layout)
            if pool is not None:
                return pool
            if len(self._pools) >= self.settings.pool.max_layouts:
                raise ResourceExhausted(
                    f"the daemon serves {len(self._pools)} layouts already (pool.max_layouts); "
                    f"cannot create a pool for {layout.model_id}")
            observer = self._observer_for(layout.model_id) if self._observer_for else None
            pool = LayoutPool(layout, self.settings, observer, self.quotas, self.engines, self.remote_store,
                              self.host_budget, self.ssd_budget, self.remote_keys)
            self._pools[layout] = pool
        for line in pool.capacity_lines():
            log.info("%s", line)
        for callback in self.on_created:
            callback(pool)
        return pool

    def close(self) -> None:
        """Finish in-flight moves and flush every T2 index."""
        with self._lock:
            pools, self._pools = list(self._pools.values()), {}
        for pool in pools:
            pool.close()
        if self.remote_store is not None:
            self.remote_store.close()
