"""Per-tenant quotas, in bytes per tier.

- T0 (device): the bytes of the block references a tenant's requests hold at once (a block
  shared by two of its requests counts twice, as it is released twice). A request beyond it is
  refused with RESOURCE_EXHAUSTED, naming the quota. Check and act are separate: a caller
  checks, performs the operation, then adds; everything runs on the server's event loop.
- T1 (host) and T2 (SSD): the bytes of a tenant's blocks resident in the tier. Blocks move
  down in the background, where nobody can be refused: a tenant at its limit stores a new block
  in the slot of its own least recently used block (SlotIndex.set_owner_quota), so one tenant
  cannot flush the others out of a shared tier.
Tenants without a quota of their own get the "*" quota when one is configured, else no limit.
A limit of 0 means no limit. A tenant's limits are the daemon file's `[quotas."tenant"]` table (Quota).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Mapping

from kvtierd.errors import ResourceExhausted
from kvtierd.node.tenants import Tenant
from kvtierd.planning.capacity import format_bytes

DEFAULT_TENANT = "*"


@dataclasses.dataclass(frozen=True, slots=True)
class Quota:
    t0_bytes: int = 0  # bytes of T0 one tenant may hold; 0 = unlimited
    t1_bytes: int = 0  # bytes of T1; 0 = unlimited
    t2_bytes: int = 0  # bytes of T2; 0 = unlimited


class QuotaBook:
    """Limits per tenant, and the T0 bytes each tenant holds."""

    def __init__(self, limits: Mapping[str, Quota] = {}) -> None:
        self._limits = dict(limits)
        self._default = self._limits.get(DEFAULT_TENANT, Quota())
        self._limits_by_tag = {Tenant.named(name).tag: lim for name, lim in self._limits.items()
                               if name != DEFAULT_TENANT}
        self.held_bytes: collections.Counter[str] = collections.Counter()

    def limits(self, tenant: str) -> Quota:
        return self._limits.get(tenant, self._default)

    # ----------------------------------------------------------------------------- T0

    def check(self, tenant: str, nbytes: int) -> None:
        """ResourceExhausted, naming the quota, if holding `nbytes` more would exceed it."""
        limit = self.limits(tenant).t0_bytes
        if limit and self.held_bytes[tenant] + nbytes > limit:
            raise ResourceExhausted(
                f"tenant {tenant!r} device quota full: holds {format_bytes(self.held_bytes[tenant])} of "
                f"{format_bytes(limit)}, asked for {format_bytes(nbytes)} more")

    def add(self, tenant: str, nbytes: int) -> None:
        self.held_bytes[tenant] += nbytes

    def remove(self, tenant: str, nbytes: int) -> None:
        assert self.held_bytes[tenant] >= nbytes, f"tenant {tenant!r} releases more than it holds"
        self.held_bytes[tenant] -= nbytes

    # ----------------------------------------------------------------------------- T1, T2

    @property
    def limits_lower_tiers(self) -> bool:
        return any(lim.t1_bytes or lim.t2_bytes for lim in [*self._limits.values()])

    def lower_tier_limit(self, tier: str):
        """`tag → bytes | None` for the tier's slot index (keys start with the tenant's tag)."""
        field = f"{tier}_bytes"
        default = getattr(self._default, field) or None
        by_tag = {tag: getattr(lim, field) or None for tag, lim in self._limits_by_tag.items()}
        return lambda tag: by_tag.get(tag, default)



