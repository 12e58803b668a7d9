"""What one tier of a layout makes of the retention hints: the class each block evicts in, and the
tenant's quota of retained blocks there."""

from __future__ import annotations

import collections
from collections.abc import Callable

from kvtierd.daemon_key import DaemonKey, TenantTag, tenant_tag_of
from kvtierd.retention.hint import Priority
from kvtierd.retention.hint_table import HintTable
from kvtierd.tier import Tier


class TierRetention:
    """The retention classes of one tier's evictable blocks, over the layout's HintTable.

    A block enters its class when it becomes evictable (`enter`) and leaves it when it is evicted,
    used or dropped (`leave`); its class is its effective priority, except that a tenant whose
    evictable retained blocks in this tier reached `limit_blocks()` (retention.max_tenant_share of
    the tier's capacity) gets NONE for further ones, counted in `num_downgraded_blocks`.
    `num_retained_of(tag)` is the tenant's evictable blocks in a class above NONE here.
    Called only under the owning tier's lock (the counters are that lock's); read from elsewhere
    as a snapshot.
    """

    def __init__(self, tier: Tier, table: HintTable, limit_blocks: Callable[[], int]) -> None:
        self.tier = tier
        self.table = table
        self.limit_blocks = limit_blocks
        self._num_retained: collections.Counter[TenantTag] = collections.Counter()
        self.num_downgraded_blocks = 0

    def class_of(self, key: DaemonKey, now: float | None = None) -> Priority:
        """The class `key` evicts in if it entered now (its own current count not included)."""
        priority = self.table.priority(key, now)
        if priority is Priority.NONE:
            return priority
        if self._num_retained[tenant_tag_of(key)] >= self.limit_blocks():
            self.num_downgraded_blocks += 1
            return Priority.NONE
        return priority

    def enter(self, key: DaemonKey, now: float | None = None) -> Priority:
        """`key` became evictable here: its class, counted."""
        priority = self.class_of(key, now)
        if priority is not Priority.NONE:
            self._num_retained[tenant_tag_of(key)] += 1
        return priority

    def leave(self, key: DaemonKey, priority: Priority) -> None:
        """`key`, evictable in class `priority`, is no longer."""
        if priority is not Priority.NONE:
            tag = tenant_tag_of(key)
            self._num_retained[tag] -= 1
            assert self._num_retained[tag] >= 0, "left a class more often than entered"

    def num_retained_of(self, tag: TenantTag) -> int:
        return self._num_retained[tag]

    def snapshot(self) -> dict[TenantTag, int]:
        """Per tenant, its evictable blocks here in a class above NONE."""
        return {tag: n for tag, n in list(self._num_retained.items()) if n}

    def room_for(self, tag: TenantTag) -> int:
        """How many more of the tenant's blocks may enter a retained class here now."""
        return max(0, self.limit_blocks() - self._num_retained[tag])
