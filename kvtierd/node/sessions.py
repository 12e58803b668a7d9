"""Sessions: the leases under which clients hold device blocks.

A session is opened by Attach and lives while a KeepAlive stream of it is open, or until
`lease_s` after its last call. When its last stream closes (the client exited, crashed or was
killed: the kernel closes its socket) or its lease runs out, every request it still holds is
released exactly once and the references are counted as reclaimed. A runner killed with
SIGKILL therefore leaks nothing (the incident of seed 003: free blocks falling 366 an hour).

Invariants: a request is in `SessionLease.requests` iff the block index has a table for its key
`(session_id, request_id)`; the tenant's quota holds exactly the bytes of those tables.
Everything here runs on the server's event loop; only a release that must wait for a promotion
in flight leaves it (to a thread).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import time
from collections.abc import Callable

from kvtierd.errors import FailedPrecondition, InvalidArgument, NotFound, PermissionDenied
from kvtierd.node.pools import LayoutPool
from kvtierd.node.quotas import QuotaBook
from kvtierd.node.tenants import Tenant
from kvtierd.tiering.promotion import Ticket

log = logging.getLogger(__name__)

MAX_REQUEST_ID_CHARS = 256


@dataclasses.dataclass(slots=True)
class HeldRequest:
    """What a live request holds: its block references, its promotion ticket, and the client hash
    its first block continues (None: the root; set when its Acquire continued a chain stored before)."""

    num_blocks: int
    ticket: Ticket | None = None
    first_parent: bytes | None = None


@dataclasses.dataclass(eq=False)
class SessionLease:
    """The daemon's record of one attached session (the client's side is kvtierd.client.Session):
    its tenant, its layout's pool, the requests whose blocks it holds, and the lease that gives
    them back when the client goes silent. Mutated on the event loop only."""

    session_id: str
    tenant: Tenant
    pool: LayoutPool
    lease_deadline_s: float
    requests: dict[str, HeldRequest] = dataclasses.field(default_factory=dict)
    num_streams: int = 0  # KeepAlive streams open
    closed: bool = False

    def key(self, request_id: str) -> tuple[str, str]:
        """The request's key in the block index."""
        return (self.session_id, request_id)

    def held(self, request_id: str) -> HeldRequest:
        held = self.requests.get(request_id)
        if held is None:
            raise FailedPrecondition(f"request {request_id!r} is not held by this session")
        return held

    def check_new(self, request_id: str) -> None:
        if not request_id or len(request_id) > MAX_REQUEST_ID_CHARS:
            raise InvalidArgument(f"request_id must be 1-{MAX_REQUEST_ID_CHARS} characters")
        if request_id in self.requests:
            raise FailedPrecondition(f"request {request_id!r} is already held by this session")


class SessionTable:
    """Live sessions by id; opens, renews, reclaims."""

    def __init__(self, lease_s: float, quotas: QuotaBook, on_opened: Callable[[], None] | None = None,
                 on_closed: Callable[[int, str], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.lease_s = lease_s
        self.quotas = quotas
        self._on_opened = on_opened  # metrics
        self._on_closed = on_closed  # (num reclaimed refs, reason): metrics
        self._clock = clock
        self._sessions: dict[str, SessionLease] = {}
        self._closing: set[asyncio.Task] = set()
        self.num_reclaimed_refs = 0

    def open_sessions(self) -> list[SessionLease]:
        return list(self._sessions.values())

    def __len__(self) -> int:
        return len(self._sessions)

    def open(self, tenant: Tenant, pool: LayoutPool) -> SessionLease:
        session = SessionLease(secrets.token_hex(16), tenant, pool, self._clock() + self.lease_s)
        self._sessions[session.session_id] = session
        if self._on_opened is not None:
            self._on_opened()
        return session

    def get(self, session_id: str, tenant: Tenant) -> SessionLease:
        """The caller's live session, its lease renewed."""
        session = self._sessions.get(session_id)
        if session is None:
            raise NotFound(f"session {session_id[:64]!r} is unknown or was reclaimed (its lease ran out or its "
                           "KeepAlive stream closed): attach again")
        if session.tenant != tenant:
            raise PermissionDenied("this session belongs to another tenant")
        session.lease_deadline_s = self._clock() + self.lease_s
        return session

    # ----------------------------------------------------------------------------- requests

    def hold(self, session: SessionLease, request_id: str, num_blocks: int, ticket: Ticket | None = None,
             first_parent: bytes | None = None) -> None:
        session.requests[request_id] = HeldRequest(num_blocks, ticket, first_parent)
        self.quotas.add(session.tenant.name, num_blocks * session.pool.layout.bytes_per_block)

    def grow(self, session: SessionLease, request_id: str, num_blocks: int) -> None:
        session.held(request_id).num_blocks += num_blocks
        self.quotas.add(session.tenant.name, num_blocks * session.pool.layout.bytes_per_block)

    def check_quota(self, session: SessionLease, num_blocks: int) -> None:
        self.quotas.check(session.tenant.name, num_blocks * session.pool.layout.bytes_per_block)

    async def release(self, session: SessionLease, request_id: str) -> int:
        """Release one request's blocks (after its promotion, if one is in flight). Returns how
        many block references it held."""
        held = session.requests.pop(request_id, None)
        if held is None:
            raise FailedPrecondition(f"request {request_id!r} is not held by this session")
        manager = session.pool.manager
        key = session.key(request_id)
        if held.ticket is not None and not held.ticket.done():
            await asyncio.to_thread(manager.release, key)
        else:
            manager.release(key)
        self.quotas.remove(session.tenant.name, held.num_blocks * session.pool.layout.bytes_per_block)
        return held.num_blocks

    # ----------------------------------------------------------------------------- leases

    def stream_opened(self, session: SessionLease) -> None:
        session.num_streams += 1

    def stream_closed(self, session: SessionLease) -> None:
        """The last stream of a session closed: reclaim it (scheduled, so that a cancelled
        handler's cleanup cannot be interrupted)."""
        session.num_streams -= 1
        if session.num_streams == 0 and not session.closed:
            self._schedule_close(session, "stream_closed")

    def expire(self) -> int:
        """Reclaim sessions whose lease ran out with no stream open; returns how many."""
        now = self._clock()
        expired = [s for s in self._sessions.values()
                   if s.num_streams == 0 and s.lease_deadline_s < now and not s.closed]
        for session in expired:
            self._schedule_close(session, "lease_expired")
        return len(expired)

    async def run_reaper(self, period_s: float) -> None:
        while True:
            await asyncio.sleep(period_s)
            self.expire()

    def _schedule_close(self, session: SessionLease, reason: str) -> None:
        task = asyncio.get_running_loop().create_task(self.close(session, reason))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def close(self, session: SessionLease, reason: str) -> int:
        """Release everything the session holds, exactly once; returns the references reclaimed."""
        if session.closed:
            return 0
        session.closed = True
        self._sessions.pop(session.session_id, None)
        num_refs = 0
        for request_id in list(session.requests):
            if request_id not in session.requests:  # a Release in flight took it meanwhile
                continue
            try:
                num_refs += await self.release(session, request_id)
            except Exception:  # one bad request must not leak the others
                log.exception("reclaiming request %r of session %s failed", request_id, session.session_id[:8])
        self.num_reclaimed_refs += num_refs
        if num_refs:
            log.info("session %s of tenant %s closed (%s): reclaimed %d block references",
                     session.session_id[:8], session.tenant.name, reason, num_refs)
        if self._on_closed is not None:
            self._on_closed(num_refs, reason)
        return num_refs

    async def close_all(self, reason: str = "shutdown") -> int:
        num_refs = sum([await self.close(s, reason) for s in list(self._sessions.values())])
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)
        return num_refs
