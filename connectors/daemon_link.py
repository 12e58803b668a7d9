"""A lazily attached, self-healing kvtierd session for one side of the vLLM connector.

An inference engine must not crash because the cache daemon is down, slow to start, or
restarted. `DaemonLink.session()` returns an attached `kvtierd.client.Session`, or None while
the daemon cannot be reached; the caller then degrades to "no hit" / "no store". Attach is
retried at most every `retry_after_s`. A call that fails with Unavailable or NotFound (the
daemon restarted and forgot the session) marks the session stale through `failed()`, and the
next `session()` attaches afresh.

A stale session's mapped pool is not unmapped until `close()`: another thread may still be
copying through it, and unmapping under a copy would fault the engine. A daemon restart thus
leaves one old mapping behind until the engine shuts down.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

import torch

from kvtierd.client import KvtierClient, Session
from kvtierd.errors import KvtierError, NotFound, Unavailable
from kvtierd.layout import Layout
from kvtierd.planning.capacity import format_bytes
from kvtierd.wire.conversions import layout_from_proto

log = logging.getLogger(__name__)

DEFAULT_RETRY_AFTER_S = 5.0
DEFAULT_TIMEOUT_S = 5.0


class DaemonLink:
    """One client and at most one live session; thread-safe.

    Invariants: `_session` is None or open; sessions that went stale are kept in
    `_stale_sessions` (pools still mapped) until `close()`; no attach is tried before
    `_next_attach_at` (monotonic seconds).
    """

    def __init__(self, layout: Layout, *, target: str | None = None, token: str | None = None,
                 hash_algo: str = "sha256", map_pool: bool, timeout_s: float = DEFAULT_TIMEOUT_S,
                 retry_after_s: float = DEFAULT_RETRY_AFTER_S,
                 client_factory: Callable[..., KvtierClient] = KvtierClient) -> None:
        if retry_after_s < 0 or timeout_s <= 0:
            raise ValueError(f"need retry_after_s >= 0 and timeout_s > 0, got {retry_after_s}, {timeout_s}")
        self.layout = layout
        self.target = target
        self.token = token
        self.hash_algo = hash_algo
        self.map_pool = map_pool
        self.timeout_s = timeout_s
        self.retry_after_s = retry_after_s
        self._client_factory = client_factory
        self._lock = threading.Lock()
        self._client: KvtierClient | None = None
        self._session: Session | None = None
        self._stale_sessions: list[Session] = []
        self._next_attach_at = 0.0
        self.num_attach_failures = 0
        self.closed = False

    def session(self, attach: bool = True, deadline_s: float | None = None) -> Session | None:
        """The live session, attaching if due (unless `attach` is False: a caller that must not wait
        for an Attach, which may take seconds; `deadline_s` bounds one, default the client's Attach
        deadline); None while the daemon cannot be reached."""
        with self._lock:
            if self._session is not None and not self._session.closed:
                return self._session
            if self.closed or not attach or time.monotonic() < self._next_attach_at:
                return None
            try:
                if self._client is None:
                    self._client = self._client_factory(self.target, token=self.token, timeout_s=self.timeout_s)
                self._session = self._client.attach(self.layout, map_pool=self.map_pool, hash_algo=self.hash_algo,
                                                    deadline_s=deadline_s)
            except (KvtierError, OSError, RuntimeError) as error:
                self.num_attach_failures += 1
                self._next_attach_at = time.monotonic() + self.retry_after_s
                log.warning("kvtierd connector: cannot attach to kvtierd at %s (%s: %s); serving without the "
                            "cache, next try in %.0f s", self.target or "the default socket", type(error).__name__,
                            error, self.retry_after_s)
                return None
            log.info("kvtierd connector: attached to kvtierd at %s, session %s (%s, pool mapped: %s); %s",
                     self._client.target, self._session.session_id, self.layout.model_id, self.map_pool,
                     self._tiers_line(self._client))
            return self._session

    def _tiers_line(self, client: KvtierClient) -> str:
        """The daemon's version and its tiers' capacities for this layout, from one Stats call."""
        try:
            stats = client.stats()
        except (KvtierError, OSError, RuntimeError) as error:
            return f"tiers unknown ({type(error).__name__})"
        pool = next((p for p in stats.pools if layout_from_proto(p.layout) == self.layout), None)
        tiers = [f"{t.tier} {format_bytes(t.capacity_bytes)}" for t in (pool.tiers if pool else ())]
        if stats.remote.enabled:
            tiers.append("t3 shared")
        return f"kvtierd {stats.version}, tiers: {', '.join(tiers) or 'none reported'}"

    def failed(self, session: Session, error: BaseException) -> None:
        """Report a failed call on `session`: an unreachable daemon or a forgotten session makes
        it stale (re-attach after `retry_after_s`); other errors leave it in use."""
        if not isinstance(error, (Unavailable, NotFound)):
            return
        with self._lock:
            if self._session is session:
                self._stale_sessions.append(session)
                self._session = None
                self._next_attach_at = time.monotonic() + self.retry_after_s

    def close(self) -> None:
        """Close every session (unmapping pools) and the client. Idempotent."""
        with self._lock:
            self.closed = True
            sessions = self._stale_sessions + ([self._session] if self._session is not None else [])
            self._session, self._stale_sessions = None, []
            client, self._client = self._client, None
        for session in sessions:
            session.close()
        if client is not None:
            client.close()


def mapped_pool(session: Session) -> torch.Tensor:
    """The pool `session` mapped (a worker's link maps it: `map_pool`), as the tensor the copies address."""
    assert session.pool is not None, "a worker's session maps the pool (DaemonLink map_pool)"
    return session.pool.tensor
