"""What one tier of a layout makes of the retention hints: the class each block evicts in, and the
tenant's quota of retained blocks there."""

from __future__ import annotations

import collections
import heapq
import itertools
from collections.abc import Callable

from kvtierd.daemon_key import DaemonKey, TenantTag, tenant_tag_of
from kvtierd.retention.hint import Priority
from kvtierd.retention.hint_table import HintTable
from kvtierd.tier import Tier


class TierRetention:
    """The retention classes of one tier's evictable blocks, over the layout's HintTable.

    A block enters its class when it becomes evictable (`enter`) and leaves it when it is evicted,
    used or dropped (`leave`); its class is its effective priority, within the tenant's quota here:
    at most `limit_blocks()` (retention.max_tenant_share of the tier's capacity) of a tenant's
    evictable blocks are in a class above NONE. A tenant at its quota keeps its highest priorities
    there: a block whose hint has a higher priority than the tenant's weakest retained block here
    takes its place (the weakest: the lowest priority, and of those the one whose hint runs
    longest; a hint that lapsed and was not swept yet is weaker than any), and that block is
    downgraded to NONE through the tier's `downgrade` callback; otherwise the entering block is
    downgraded (among equal priorities the first retained keep the room). Each downgrade is
    counted in `num_downgraded_blocks`.
    `num_retained_of(tag)` is the tenant's evictable blocks in a class above NONE here.

    `_weakest[tag]` is a heap of (priority, -expiry, seq, key) over the tenant's retained keys here,
    validated lazily (an item whose key left, or whose hint was renewed, is skipped when reached).
    Called only under the owning tier's lock (the counters are that lock's); read from elsewhere
    as a snapshot.
    """

    def __init__(self, tier: Tier, table: HintTable, limit_blocks: Callable[[], int]) -> None:
        self.tier = tier
        self.table = table
        self.limit_blocks = limit_blocks
        self._num_retained: collections.Counter[TenantTag] = collections.Counter()
        self._num_by_priority: dict[TenantTag, collections.Counter[Priority]] = collections.defaultdict(
            collections.Counter)
        self._retained: dict[DaemonKey, tuple[Priority, float]] = {}  # retained keys here: class and expiry
        self._copies: collections.Counter[DaemonKey] = collections.Counter()  # of each retained key (T0 has copies)
        self._weakest: dict[TenantTag, list[tuple[Priority, float, int, DaemonKey]]] = collections.defaultdict(list)
        self._seq = itertools.count()
        self.num_downgraded_blocks = 0
        # moves a retained key's block to class NONE and calls `leave` for it (set by the tier's
        # eviction order before any hint; without it a tenant at its quota downgrades entering blocks)
        self.downgrade: Callable[[DaemonKey], None] | None = None

    def class_of(self, key: DaemonKey, now: float | None = None) -> Priority:
        """The class `key` would enter in now (its own current count not included)."""
        return self._admit(key, now)[0]

    def enter(self, key: DaemonKey, now: float | None = None) -> Priority:
        """`key` became evictable here: its class, counted (a weaker retained block of the tenant
        may be downgraded to make room for it)."""
        priority, expires_at_s = self._admit(key, now)
        if priority is not Priority.NONE:
            tag = tenant_tag_of(key)
            self._num_retained[tag] += 1
            self._num_by_priority[tag][priority] += 1
            self._retained[key] = priority, expires_at_s
            self._copies[key] += 1
            heap = self._weakest[tag]
            heapq.heappush(heap, (priority, -expires_at_s, next(self._seq), key))
            if len(heap) > 2 * self._num_retained[tag] + 64:  # left or renewed keys' items: rebuild
                self._weakest[tag] = [(p, -e, next(self._seq), k) for k, (p, e) in self._retained.items()
                                      if tenant_tag_of(k) == tag]
                heapq.heapify(self._weakest[tag])
        return priority

    def leave(self, key: DaemonKey, priority: Priority) -> None:
        """`key`, evictable in class `priority`, is no longer."""
        if priority is not Priority.NONE:
            tag = tenant_tag_of(key)
            self._num_retained[tag] -= 1
            assert self._num_retained[tag] >= 0, "left a class more often than entered"
            self._num_by_priority[tag][priority] -= 1
            self._copies[key] -= 1
            if not self._copies[key]:
                del self._copies[key], self._retained[key]

    def num_retained_of(self, tag: TenantTag) -> int:
        return self._num_retained[tag]

    def snapshot(self) -> dict[TenantTag, int]:
        """Per tenant, its evictable blocks here in a class above NONE."""
        return {tag: n for tag, n in list(self._num_retained.items()) if n}

    def room_for(self, tag: TenantTag, priority: Priority = Priority.LOW) -> int:
        """How many more of the tenant's blocks may enter a class of `priority` here now (taking
        the room of its retained blocks of lower priorities where it must)."""
        num_as_strong = sum(n for p, n in self._num_by_priority[tag].items() if p >= priority)
        return max(0, self.limit_blocks() - num_as_strong)

    def _admit(self, key: DaemonKey, now: float | None) -> tuple[Priority, float]:
        """The class and expiry `key` enters with: its hint's, or NONE (downgraded, counted) when
        the tenant is at its quota and holds nothing weaker here."""
        priority, expires_at_s = self.table.strength(key, now)
        if priority is Priority.NONE:
            return priority, 0.0
        tag = tenant_tag_of(key)
        if self._num_retained[tag] < self.limit_blocks() or self._displace(tag, priority, expires_at_s):
            return priority, expires_at_s
        self.num_downgraded_blocks += 1
        return Priority.NONE, 0.0

    def _displace(self, tag: TenantTag, priority: Priority, expires_at_s: float) -> bool:
        """Downgrade the tenant's weakest retained block here if its priority is below `priority`
        (or its hint lapsed); True when one was."""
        if self.downgrade is None:
            return False
        heap, now = self._weakest[tag], self.table.now()
        while heap:
            weak_priority, neg_expiry, _, weak_key = heap[0]
            if self._retained.get(weak_key) != (weak_priority, -neg_expiry):
                heapq.heappop(heap)  # the key left, or its class or expiry changed (pushed again then)
                continue
            lapsed = -neg_expiry <= now  # not swept yet: weaker than any live hint
            if not lapsed and weak_priority >= priority:
                return False  # every retained block of the tenant here is at least as strong
            if self._copies[weak_key] == 1:
                heapq.heappop(heap)
            num_retained = self._num_retained[tag]
            self.downgrade(weak_key)  # one copy of it: calls leave(weak_key, ...)
            assert self._num_retained[tag] == num_retained - 1, "a downgrade leaves the retained classes"
            self.num_downgraded_blocks += 1
            return True
        return False
