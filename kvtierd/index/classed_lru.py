"""The evictable entries of a slot index in eviction order: one list per retention class, class NONE
in the tier's eviction order (eviction_order.py), the retained classes LRU."""

from __future__ import annotations

import collections
import itertools
from collections.abc import Iterable, Iterator

from kvtierd.daemon_key import DaemonKey
from kvtierd.index.eviction_order import EvictionOrder, make_eviction_order
from kvtierd.index.slot_entry import SlotEntry
from kvtierd.retention.hint import NUM_CLASSES, Priority
from kvtierd.retention.tier_retention import TierRetention


class ClassedLru:
    """An OrderedDict's surface (what SlotIndex uses of one) over one LRU list per retention class:
    `popitem(last=False)` takes the least recently used entry of the lowest class that has any —
    entries without a live hint first, then LOW, NORMAL, HIGH — so no eviction scans the tier.
    Class NONE leaves in the order `set_eviction` names (LRU unless told; S3-FIFO counts a key's
    return after a load as a hit, so SlotIndex tells it, by `forget`, when a key left the tier).

    Without `retention` (or while no hint lives) every entry is in class NONE: under "lru" the order
    is exactly one OrderedDict's. An entry's class is decided when it is inserted (TierRetention.enter)
    and again by `reclassify` (a hint set, released or expired); a retained class's head whose hint
    has lapsed is moved down when it is reached (lazily), so a stale class never outlives the
    sweep that follows. A lapsed entry goes to the head of class NONE: it stayed past its natural
    eviction, and is the next victim. `_classes[0]` holds class NONE's entries, `_order` their keys
    (exactly the same keys). Mutated only under the owning SlotIndex's lock.
    """

    def __init__(self) -> None:
        self._classes: list[dict[DaemonKey, SlotEntry]] = [
            {} if priority is Priority.NONE else collections.OrderedDict() for priority in Priority]
        self._order: EvictionOrder[DaemonKey] = make_eviction_order("lru")
        self._retained: dict[DaemonKey, Priority] = {}  # the class of each entry above NONE
        self.retention: TierRetention | None = None  # set once, before hints are set (SlotIndex.set_retention)

    def __len__(self) -> int:
        return sum(map(len, self._classes))

    def __bool__(self) -> bool:
        return any(self._classes)

    def __contains__(self, key: DaemonKey) -> bool:
        return key in self._classes[0] or key in self._retained

    def values(self) -> Iterator[SlotEntry]:
        """Every entry, next victim first."""
        unhinted = self._classes[0]
        return itertools.chain((unhinted[key] for key in self._order),
                               itertools.chain.from_iterable(c.values() for c in self._classes[1:]))

    def set_retention(self, retention: TierRetention) -> None:
        """Evict by retention class over `retention` from now on; set once, before any hint."""
        self.retention = retention
        retention.downgrade = self._downgrade

    def _downgrade(self, key: DaemonKey) -> None:
        """TierRetention gives the room of retained `key` to a stronger hint: `key` to class NONE,
        as the most recently used there (its hint still lives)."""
        priority = self._retained.pop(key)
        assert self.retention is not None
        self.retention.leave(key, priority)
        self._classes[0][key] = self._classes[priority].pop(key)
        self._order.insert(key)

    def set_eviction(self, name: str) -> None:
        """Class NONE in the order called `name` from now on; its entries move over, next victim first."""
        order: EvictionOrder[DaemonKey] = make_eviction_order(name)
        for key in self._order:
            order.insert(key)
        self._order = order

    def forget(self, key: DaemonKey) -> None:
        """The entry of `key` left the tier (after it left this order): its history goes too."""
        assert key not in self, "an evictable entry is popped or deleted first"
        self._order.discard(key)

    def __setitem__(self, key: DaemonKey, entry: SlotEntry) -> None:
        """Insert as the most recently used of its class (in class NONE: as its order takes a key)."""
        assert key not in self, "an entry is inserted once"
        retention = self.retention
        priority = retention.enter(key) if retention is not None and len(retention.table) else Priority.NONE
        if priority is Priority.NONE:
            self._order.insert(key)
        else:
            self._retained[key] = priority
        self._classes[priority][key] = entry

    def __delitem__(self, key: DaemonKey) -> None:
        if self.pop(key, None) is None:
            raise KeyError(key)

    def pop(self, key: DaemonKey, default: SlotEntry | None = None) -> SlotEntry | None:
        priority = self._retained.pop(key, None)
        if priority is None:
            entry = self._classes[0].pop(key, None)
            if entry is None:
                return default
            self._order.remove(key)
            return entry
        assert self.retention is not None
        self.retention.leave(key, priority)
        return self._classes[priority].pop(key)

    def popitem(self, last: bool = True) -> tuple[DaemonKey, SlotEntry]:
        """The next victim (last=False): the least recently used entry of the lowest class."""
        assert not last, "only the eviction end is taken"
        self._settle_heads()
        if self._order:
            key = self._order.pop()
            return key, self._classes[0].pop(key)
        for priority in range(1, NUM_CLASSES):
            entries = self._classes[priority]
            if entries:
                assert isinstance(entries, collections.OrderedDict)
                key, entry = entries.popitem(last=False)
                assert self.retention is not None
                self.retention.leave(key, self._retained.pop(key))
                return key, entry
        raise KeyError("popitem(): no evictable entry")

    def reclassify(self, keys: Iterable[DaemonKey]) -> None:
        """The hints of `keys` (a chain, head first) changed: move those here to their class now.
        The classes are taken head first (a quota short of the chain retains its head), the classes'
        orders entered tail first (the chain's tail leaves its class first)."""
        if self.retention is None:
            return
        moves = [move for key in keys if (move := self._change_class(key)) is not None]
        for key, old, new in reversed(moves):
            self._move(key, old, new)

    def _reclassify(self, key: DaemonKey) -> None:
        if (move := self._change_class(key)) is not None:
            self._move(*move)

    def _change_class(self, key: DaemonKey) -> tuple[DaemonKey, Priority, Priority] | None:
        """The key's class anew (its hint, within the quota): (key, old, new), or None when it is not
        here or keeps its class."""
        retention = self.retention
        assert retention is not None
        old = self._retained.pop(key, None)
        if old is None:
            if key not in self._classes[0]:
                return None
            old = Priority.NONE
        else:
            retention.leave(key, old)
        new = retention.enter(key)
        if new is not Priority.NONE:
            self._retained[key] = new
        return None if new is old else (key, old, new)

    def _move(self, key: DaemonKey, old: Priority, new: Priority) -> None:
        """From class `old`'s order to class `new`'s."""
        entry = self._classes[old].pop(key)
        self._classes[new][key] = entry
        if old is Priority.NONE:
            self._order.remove(key)
        elif new is Priority.NONE:
            self._order.insert_first(key)  # lapsed: the next victim

    def _settle_heads(self) -> None:
        """Move down each retained class's head whose hint lapsed, until every head is live."""
        retention = self.retention
        if retention is None or not self._retained:
            return
        now = retention.table.now()
        for priority in range(NUM_CLASSES - 1, 0, -1):
            entries = self._classes[priority]
            while entries:
                key = next(iter(entries))
                if retention.table.priority(key, now) >= priority:
                    break
                self._reclassify(key)
