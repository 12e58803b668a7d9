"""What an operator asks of a running daemon (kvtierctl): usage per tenant, evict, flush, forget, drain.

Tenants are known to the tiers only by the 16-byte tag every key starts with (tenants.py);
`Operations` remembers the name behind each tag it has seen (callers, configured tokens), and
reports a tag it cannot name as `tag:<hex>` (T2 blocks of a tenant not seen since a restart).

Authority: a tenant may look at and evict its own blocks; another tenant's, every tenant's, and
Drain need an admin tenant (server.admin_tenants), else PERMISSION_DENIED. Evict drops only
blocks nobody holds: from T0 alone it is an eviction (the on_evict policy copies them down
first), from T1 and T2 the slots are freed; an evict that names T1 or T2 as well drops T0's
blocks without copying them down, so that nothing lands behind it; all three tiers is a flush.

Forget (admin only, with [encryption] on) destroys a tenant's data keys first, durably: with a T3,
its shared key in the store (sealing/shared_tenant_keys.py: from then on no node opens any of its
T3 values; a store that does not answer refuses the forget before anything changed), then the
node's own (none of its sealed T2 blocks opens, here or after a restart); its next store makes
new keys. Then it drops the tenant's queued T3 writes and flushes it from every pool: T0's unheld
blocks without copying them down, T1, T2. A copy of the tenant's that was in flight then (T0 →
T1, T1 → T2, T1 → T3, a T1 slot pinned by its copy) may land after that flush, sealed under a new
key: forget waits for the pools' copies and T3 writes in flight (FORGET_SETTLE_S at most), drops
and flushes again, and destroys the keys again if one was made meanwhile. `settled` says whether
all of that ended in time (if not, forget again).
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

from kvtierd.daemon_key import DaemonKey, tenant_tag_of
from kvtierd.errors import FailedPrecondition, InvalidArgument, PermissionDenied
from kvtierd.node.pools import LayoutPool, PoolRegistry
from kvtierd.node.sessions import SessionTable
from kvtierd.node.tenants import Tenant
from kvtierd.tier import LOCAL_TIERS, Tier

if TYPE_CHECKING:
    from kvtierd.daemon_key import TenantTag
    from kvtierd.sealing.tenant_keys import TenantKeys

EVERY_TENANT = "*"
MAX_TENANT_NAME_CHARS = 256
FORGET_SETTLE_S = 10.0  # how long forget waits for the copies in flight before its second flush


@dataclasses.dataclass(slots=True)
class EvictCounts:
    t0: int = 0
    t1: int = 0
    t2: int = 0
    t0_held: int = 0  # skipped: requests hold them

    def then(self, later: EvictCounts) -> EvictCounts:
        """These and a later pass's drops together; the held blocks are the later pass's."""
        return EvictCounts(self.t0 + later.t0, self.t1 + later.t1, self.t2 + later.t2, later.t0_held)


@dataclasses.dataclass(frozen=True, slots=True)
class Forgotten:
    key_destroyed: bool  # the tenant had a data key (the node's, or its shared T3 key), now destroyed
    dropped: EvictCounts
    settled: bool  # the copies in flight landed within FORGET_SETTLE_S, before the second flush


class Operations:
    """Operator actions on the daemon's pools. `draining` is read by Attach (never mutated there)."""

    def __init__(self, registry: PoolRegistry, sessions: SessionTable, admin_tenants: Iterable[str],
                 known_tenants: Iterable[str] = (), tenant_keys: TenantKeys | None = None) -> None:
        """`tenant_keys`: the node's data keys ([encryption] on); None: forget is refused."""
        self.registry = registry
        self.tenant_keys = tenant_keys
        self.sessions = sessions
        self.admin_tenants = frozenset(admin_tenants)
        self._names: dict[bytes, str] = {}
        for name in known_tenants:
            self.remember(Tenant.named(name))
        self.draining = False

    def remember(self, tenant: Tenant) -> None:
        self._names[tenant.tag] = tenant.name

    def name_of(self, tag: bytes) -> str:
        return self._names.get(tag) or f"tag:{tag.hex()}"

    def check_admin(self, caller: Tenant, action: str) -> None:
        if caller.name not in self.admin_tenants:
            raise PermissionDenied(f"{action} needs an admin tenant (server.admin_tenants); "
                                   f"tenant {caller.name!r} is not one")

    def _target_tags(self, caller: Tenant, tenant: str, all_tenants: bool, action: str) -> set[bytes] | None:
        """The tags to act on (None: every tenant), after the authority checks."""
        if all_tenants or tenant == EVERY_TENANT:
            if tenant not in ("", EVERY_TENANT):
                raise InvalidArgument("name a tenant or ask for every tenant, not both")
            self.check_admin(caller, f"{action} of every tenant")
            return None
        if tenant and tenant != caller.name:
            self.check_admin(caller, f"{action} of another tenant ({tenant!r})")
            target = Tenant.named(tenant)
            self.remember(target)
            return {target.tag}
        return {caller.tag}

    # ----------------------------------------------------------------------------- usage

    def tenant_usage(self, caller: Tenant, tenant: str) -> list[dict]:
        """Per (tenant, pool): held and cached T0 blocks, T1 and T2 blocks, sessions."""
        return self.usage_rows(self._target_tags(caller, tenant, False, "usage"))

    def usage_rows(self, tags: set[bytes] | None = None) -> list[dict]:
        """The rows of `tenant_usage` for these tenant tags (None: every tenant), unchecked:
        for the caller-checked RPC above and for the metrics scrape."""
        rows = []
        for pool in self.registry.pools():
            counts, retained = _pool_counts(pool)
            held, sessions = collections.Counter(), collections.Counter()
            for session in self.sessions.open_sessions():
                if session.pool is pool:
                    sessions[session.tenant.tag] += 1
                    held[session.tenant.tag] += sum(r.num_blocks for r in session.requests.values())
            seen = set(held) | set(sessions) | {tag for tier in counts.values() for tag in tier}
            for tag in seen if tags is None else seen & tags:
                rows.append(dict(tenant=self.name_of(tag), model_id=pool.layout.model_id,
                                 num_t0_held_blocks=held[tag], num_t0_cached_blocks=counts[Tier.T0][tag],
                                 num_t1_blocks=counts[Tier.T1][tag], num_t2_blocks=counts[Tier.T2][tag],
                                 bytes_per_block=pool.layout.bytes_per_block, num_sessions=sessions[tag],
                                 num_t0_retained_blocks=retained[Tier.T0][tag],
                                 num_t1_retained_blocks=retained[Tier.T1][tag],
                                 num_t2_retained_blocks=retained[Tier.T2][tag]))
        return sorted(rows, key=lambda row: (row["tenant"], row["model_id"]))

    # ----------------------------------------------------------------------------- evict, flush

    def evict(self, caller: Tenant, tenant: str, all_tenants: bool, tiers: Iterable[str],
              pools: list[LayoutPool] | None = None) -> EvictCounts:
        """Drop the target tenants' unheld blocks from `tiers` (all three when empty). T0's blocks
        are copied down first only when no lower tier is named (an evict of every tier leaves
        nothing behind). Blocking: T0 evictions may copy down, T2 removals write the index; run it
        off the event loop."""
        tiers = list(tiers) or list(LOCAL_TIERS)
        unknown = [t for t in tiers if t not in LOCAL_TIERS]
        if unknown:
            raise InvalidArgument(f"unknown tier(s) {', '.join(map(repr, unknown))}; tiers are t0, t1, t2")
        tags = self._target_tags(caller, tenant, all_tenants, "evict")

        def mine(keys: Iterable[DaemonKey]) -> list[DaemonKey]:
            return [k for k in keys if tags is None or tenant_tag_of(k) in tags]

        counts = EvictCounts()
        for pool in self.registry.pools() if pools is None else pools:
            tier_state = pool.manager.tiers
            if Tier.T0 in tiers:
                keys = mine(tier_state.index.cached_hashes())
                num_evicted = tier_state.index.evict(keys, copy_down=not {Tier.T1, Tier.T2} & set(tiers))
                counts.t0 += num_evicted
                counts.t0_held += len(keys) - num_evicted
            if Tier.T1 in tiers and tier_state.host is not None:
                counts.t1 += len(tier_state.host.index.remove(mine(e.block_hash
                                                                   for e in tier_state.host.index.entries())))
            if Tier.T2 in tiers and tier_state.ssd is not None:
                counts.t2 += tier_state.ssd.remove(mine(tier_state.ssd.block_hashes()))
        return counts

    # ----------------------------------------------------------------------------- forget

    def check_forget(self, caller: Tenant, tenant: str) -> Tenant:
        """The tenant a Forget names, after every check (nothing changed yet)."""
        if not tenant or tenant == EVERY_TENANT or len(tenant) > MAX_TENANT_NAME_CHARS or tenant != tenant.strip():
            raise InvalidArgument("forget names one tenant: a name of 1 to 256 characters without surrounding "
                                  f"spaces, not {EVERY_TENANT!r}")
        self.check_admin(caller, "forget")
        if self.tenant_keys is None:
            raise FailedPrecondition("forget needs encryption on ([encryption] enabled): without it the tenant's "
                                     "T2 blocks stay readable on disk; `kvtierctl flush --tenant` drops them from "
                                     "the tiers")
        target = Tenant.named(tenant)
        self.remember(target)
        return target

    def forget(self, caller: Tenant, tenant: str, settle_s: float = FORGET_SETTLE_S) -> Forgotten:
        """Destroy the tenant's data keys, flush it from every pool, let the copies in flight land,
        flush again (module doc). Blocking: the store's calls, file deletes and fsyncs, T2 index
        writes, the wait; run it off the event loop."""
        target = self.check_forget(caller, tenant)
        destroyed = self._destroy_keys(target.tag)  # raises, changing nothing, when the store does not answer
        first = self.evict(caller, tenant, False, list(LOCAL_TIERS))
        settled = self._settle(target.tag, settle_s)
        dropped = first.then(self.evict(caller, tenant, False, list(LOCAL_TIERS)))
        try:
            destroyed = self._destroy_keys(target.tag) or destroyed  # a key a copy in flight made meanwhile
        except FailedPrecondition:  # the store stopped answering since: a key made meanwhile may live on
            settled = False
        return Forgotten(destroyed, dropped, settled)

    def _destroy_keys(self, tag: TenantTag) -> bool:
        """The tenant's shared T3 key (first: it may refuse) and the node's; its queued T3 writes dropped."""
        assert self.tenant_keys is not None  # check_forget refused otherwise
        remote_keys = self.registry.remote_keys
        destroyed = remote_keys.forget(tag) if remote_keys is not None else False
        for pool in self.registry.pools():
            if (remote := pool.manager.tiers.remote) is not None:
                remote.forget_tenant(tag)
        return self.tenant_keys.forget(tag) or destroyed

    def _settle(self, tag: TenantTag, settle_s: float) -> bool:
        """Wait for the pools' copies in flight, then for their T3 writes (the tenant's queued ones
        dropped first); False when that took longer than `settle_s`."""
        deadline_s = time.monotonic() + settle_s
        settled = all([pool.manager.tiers.wait_quiet(settle_s) for pool in self.registry.pools()])
        for pool in self.registry.pools():
            if (remote := pool.manager.tiers.remote) is not None:
                remote.forget_tenant(tag)
                settled = remote.drain(max(0.0, deadline_s - time.monotonic())) and settled
        return settled

    # ----------------------------------------------------------------------------- drain

    def drain(self, caller: Tenant, resume: bool) -> bool:
        self.check_admin(caller, "resume" if resume else "drain")
        self.draining = not resume
        return self.draining


def _pool_counts(pool: LayoutPool) -> tuple[dict[Tier, collections.Counter], dict[Tier, collections.Counter]]:
    """Blocks per tenant tag in each tier of one pool, and the unused ones a live retention hint keeps
    in a retained class there (within the tenant's quota)."""
    tiers = pool.manager.tiers
    keys = {Tier.T0: tiers.index.cached_hashes(), Tier.T1: [], Tier.T2: []}
    if tiers.host is not None:
        keys[Tier.T1] = [e.block_hash for e in tiers.host.index.entries()]
    if tiers.ssd is not None:
        keys[Tier.T2] = tiers.ssd.block_hashes()
    counts = {tier: collections.Counter(map(tenant_tag_of, tier_keys)) for tier, tier_keys in keys.items()}
    retention = pool.manager.retention  # what eviction protects: a block downgraded over a quota is not
    retained_counts = {tier: collections.Counter(retention.num_retained_by_tenant(tier)) for tier in keys}
    return counts, retained_counts
