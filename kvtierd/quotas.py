"""Per-tenant quotas: how many bytes of device blocks a tenant's sessions may hold at once.

A tenant's T0 usage is the bytes of the block references its requests hold (a block shared by
two of its requests counts twice, as it is released twice). Tenants without a quota of their
own get the "*" quota when one is configured, else no limit. Check and act are separate: a
caller checks, performs the operation, then adds; everything runs on the server's event loop.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping

from kvtierd.capacity import format_bytes
from kvtierd.errors import ResourceExhausted

DEFAULT_TENANT = "*"


class QuotaBook:
    """Bytes held per tenant against `t0_bytes` limits (0 = unlimited)."""

    def __init__(self, t0_limit_bytes: Mapping[str, int]) -> None:
        self._limit_bytes = {tenant: limit for tenant, limit in t0_limit_bytes.items() if limit > 0}
        self.held_bytes: collections.Counter[str] = collections.Counter()

    def limit_bytes(self, tenant: str) -> int:
        return self._limit_bytes.get(tenant, self._limit_bytes.get(DEFAULT_TENANT, 0))

    def check(self, tenant: str, nbytes: int) -> None:
        """ResourceExhausted, naming the quota, if holding `nbytes` more would exceed it."""
        limit = self.limit_bytes(tenant)
        if limit and self.held_bytes[tenant] + nbytes > limit:
            raise ResourceExhausted(
                f"tenant {tenant!r} device quota full: holds {format_bytes(self.held_bytes[tenant])} of "
                f"{format_bytes(limit)}, asked for {format_bytes(nbytes)} more")

    def add(self, tenant: str, nbytes: int) -> None:
        self.held_bytes[tenant] += nbytes

    def remove(self, tenant: str, nbytes: int) -> None:
        assert self.held_bytes[tenant] >= nbytes, f"tenant {tenant!r} releases more than it holds"
        self.held_bytes[tenant] -= nbytes
