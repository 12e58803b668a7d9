"""The live retention hints of one layout, per block key: who set them, how firmly, until when."""

from __future__ import annotations

import collections
import dataclasses
import heapq
import threading
import time
from collections.abc import Callable, Iterable, Sequence

from kvtierd.daemon_key import DaemonKey, TenantTag, tenant_tag_of
from kvtierd.retention.hint import Priority

MAX_LAPSED = 1 << 18  # lapsed keys remembered (~100 B each) for the tiers to say why a block left
HintListener = Callable[[list[DaemonKey]], None]  # keys whose effective priority may have changed


@dataclasses.dataclass(frozen=True, slots=True)
class LiveHint:
    priority: Priority
    expires_at_s: float  # on the table's clock


class HintTable:
    """Block key → {retention session → LiveHint}. A key's effective priority is the highest among
    its live hints (NONE without one); a hint whose expiry has passed is not live, whether or not
    `expire` has dropped it yet (lazy), and `expire` (the periodic sweep) forgets it.

    Keys are the daemon's (tenant tag first), and a session's hints are kept per key, so two
    tenants' hints never meet: a session name is the caller's own name space within its tenant's keys.
    Thread-safe: `_lock` guards `_hints`, `_by_session` and `_expiries`, and is a leaf (nothing is
    called with it held). Listeners (the tiers, which reclassify their copies of the keys) are called
    after a change, without the lock; a tier may read `priority` under its own lock.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._hints: dict[DaemonKey, dict[str, LiveHint]] = {}
        self._by_session: dict[tuple[TenantTag, str], set[DaemonKey]] = collections.defaultdict(set)
        self._expiries: list[tuple[float, DaemonKey, str]] = []  # a heap; stale items are skipped
        self._lock = threading.Lock()
        self._listeners: list[HintListener] = []
        self._num_hints = 0  # pushes since the heap was last rebuilt, an upper bound of the hints held
        # keys whose last hint lapsed (swept by `expire`) → when, newest last; a new hint drops the key,
        # the oldest go beyond MAX_LAPSED (read by the tiers' leave reasons: `lapsed_at`)
        self._lapsed: dict[DaemonKey, float] = {}

    def add_listener(self, listener: HintListener) -> None:
        self._listeners.append(listener)

    # ----------------------------------------------------------------------------- queries

    def now(self) -> float:
        return self._clock()

    def priority(self, key: DaemonKey, now: float | None = None) -> Priority:
        """The key's effective priority: the highest of its live hints, NONE without one."""
        if key not in self._hints:  # the common case, without the lock (a dict lookup is atomic)
            return Priority.NONE
        now = self._clock() if now is None else now
        with self._lock:
            hints = self._hints.get(key)
            if not hints:
                return Priority.NONE
            return max((h.priority for h in hints.values() if h.expires_at_s > now), default=Priority.NONE)

    def strength(self, key: DaemonKey, now: float | None = None) -> tuple[Priority, float]:
        """The key's effective priority and when the last of its live hints of that priority
        expires (NONE, 0.0 without a live hint)."""
        if key not in self._hints:
            return Priority.NONE, 0.0
        now = self._clock() if now is None else now
        with self._lock:
            live = [(h.priority, h.expires_at_s) for h in self._hints.get(key, {}).values() if h.expires_at_s > now]
        return max(live, default=(Priority.NONE, 0.0))

    def is_retained(self, key: DaemonKey) -> bool:
        return self.priority(key) is not Priority.NONE

    def lapsed_at(self, key: DaemonKey) -> float:
        """When the key's last hint expired (on the table's clock), if it has no live hint left and
        lapsed within the last MAX_LAPSED keys to lapse; else 0. Cheap without hints: dict lookups."""
        if key in self._hints:  # not swept yet: lapsed when no hint is live
            now = self._clock()
            with self._lock:
                hints = self._hints.get(key)
                if hints and all(h.expires_at_s <= now for h in hints.values()):
                    return max(h.expires_at_s for h in hints.values())
            return 0.0
        return self._lapsed.get(key, 0.0)

    def __len__(self) -> int:
        """Keys with at least one hint (live, or expired and not swept yet)."""
        return len(self._hints)

    # ----------------------------------------------------------------------------- changes

    def set(self, keys: Sequence[DaemonKey], session: str, priority: Priority, ttl_s: float) -> None:
        """Set (or renew) `session`'s hint on each key: `priority` until `ttl_s` from now."""
        assert priority is not Priority.NONE and ttl_s > 0
        if not keys:
            return
        expires_at_s = self._clock() + ttl_s
        hint = LiveHint(priority, expires_at_s)
        with self._lock:
            for key in keys:
                self._lapsed.pop(key, None)
                self._hints.setdefault(key, {})[session] = hint
                self._by_session[(tenant_tag_of(key), session)].add(key)
                heapq.heappush(self._expiries, (expires_at_s, key, session))
            self._num_hints += len(keys)
            if len(self._expiries) > 2 * self._num_hints + 1024:  # renewals left stale items: rebuild
                self._expiries = [(h.expires_at_s, k, s) for k, hints in self._hints.items() for s, h in hints.items()]
                heapq.heapify(self._expiries)
        self._notify(list(keys))

    def release(self, tag: TenantTag, session: str, keys: Iterable[DaemonKey] | None = None) -> int:
        """Drop `session`'s hints (of the tenant `tag`) on `keys`, or on every key when None.
        Returns how many hints were dropped."""
        with self._lock:
            held = self._by_session.get((tag, session))
            if not held:
                return 0
            chosen = list(held) if keys is None else [k for k in keys if k in held]
            for key in chosen:
                self._drop(key, session)
        self._notify(chosen)
        return len(chosen)

    def expire(self) -> int:
        """Forget every hint whose expiry has passed (the periodic sweep; cheap when none has: a
        heap). Returns how many were forgotten; the listeners hear of their keys."""
        now = self._clock()
        changed: list[DaemonKey] = []
        with self._lock:
            while self._expiries and self._expiries[0][0] <= now:
                expires_at_s, key, session = heapq.heappop(self._expiries)
                hint = self._hints.get(key, {}).get(session)
                if hint is not None and hint.expires_at_s == expires_at_s:  # not renewed since
                    self._drop(key, session)
                    changed.append(key)
                    if key not in self._hints:  # its last hint: the key lapsed
                        self._lapsed[key] = expires_at_s
            while len(self._lapsed) > MAX_LAPSED:
                del self._lapsed[next(iter(self._lapsed))]
        self._notify(changed)
        return len(changed)

    def _drop(self, key: DaemonKey, session: str) -> None:
        hints = self._hints[key]
        del hints[session]
        if not hints:
            del self._hints[key]
        by_session = self._by_session[(tenant_tag_of(key), session)]
        by_session.discard(key)
        if not by_session:
            del self._by_session[(tenant_tag_of(key), session)]

    def _notify(self, keys: list[DaemonKey]) -> None:
        if keys:
            for listener in self._listeners:
                listener(keys)
