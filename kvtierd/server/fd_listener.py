"""The fd socket's server: hands the device pool's descriptor to the runner an Attach authorized.

Protocol: kvtierd/wire/fd_passing.py. The binding, step by step:
- on accept, the connection's uid comes from SO_PEERCRED (the kernel's word, not the client's)
  and the connection gets a random peer token, sent in the greeting;
- Attach(fd_peer = that token) asks `issue()` for a ticket: bound to the session, to the uid of
  the peer connection, and to the pool's descriptor; the token of a closed connection is unknown;
- "ticket T" on any connection: T must be known and unused (it is taken now: one use), issued
  within TICKET_TTL_S, presented by the same uid, for a session still open; then "ok" carries
  the descriptor (SCM_RIGHTS). Anything else gets one "refused: …" line and no descriptor.

Everything runs on the daemon's event loop with loop.sock_* calls: nothing here blocks it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import socket
import struct
import time
from collections.abc import Callable

from kvtierd.wire.fd_passing import (
    GREETING,
    LINE_TIMEOUT_S,
    MAX_LINE_BYTES,
    OK_LINE,
    REFUSED_PREFIX,
    TICKET_PREFIX,
    TICKET_TTL_S,
)

log = logging.getLogger(__name__)

_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


@dataclasses.dataclass(frozen=True, slots=True)
class FdTicket:
    """What one ticket grants: the descriptor `fd()` returns, to `uid`, while `session_open()`."""

    uid: int
    session_id: str
    fd: Callable[[], int]  # the pool's descriptor, owned by the pool (never closed here)
    session_open: Callable[[], bool]
    issued_at: float


class TicketRefused(Exception):
    """A presented ticket that grants nothing; the message is the one-line reason sent back."""


class FdListener:
    """Serves `path` (a bound, listening unix socket) on the running loop.

    `_peers` maps the token of each open connection to its uid; `_tickets` maps each issued,
    unused ticket to its grant. Both are touched on the loop only.
    """

    def __init__(self, listening: socket.socket) -> None:
        self._listening = listening
        self._listening.setblocking(False)
        self._peers: dict[str, int] = {}
        self._tickets: dict[str, FdTicket] = {}
        self._tasks: set[asyncio.Task] = set()
        self._accepting: asyncio.Task | None = None
        self.num_sent_fds = 0
        self.num_refused = 0

    def start(self) -> None:
        self._accepting = asyncio.get_running_loop().create_task(self._accept_loop())

    async def stop(self) -> None:
        for task in [self._accepting, *self._tasks]:
            if task is not None:
                task.cancel()
        await asyncio.gather(*[t for t in [self._accepting, *self._tasks] if t is not None], return_exceptions=True)
        self._listening.close()
        self._tickets.clear()

    # ------------------------------------------------------------------------------ Attach side

    def peer_uid(self, peer_token: str) -> int | None:
        """The uid of the open connection greeted with `peer_token`; None when there is none."""
        return self._peers.get(peer_token)

    def issue(self, uid: int, session_id: str, fd: Callable[[], int], session_open: Callable[[], bool]) -> str:
        """A one-time ticket for the pool's descriptor, to `uid`, for `session_id`."""
        now = time.monotonic()
        for ticket in [t for t, grant in self._tickets.items() if now - grant.issued_at > TICKET_TTL_S]:
            del self._tickets[ticket]
        ticket = secrets.token_hex(16)
        self._tickets[ticket] = FdTicket(uid, session_id, fd, session_open, now)
        return ticket

    def redeem(self, ticket: str, uid: int) -> int:
        """Take `ticket` (good once) for a connection of `uid`: the descriptor to send, or TicketRefused."""
        grant = self._tickets.pop(ticket, None)
        if grant is None:
            raise TicketRefused("unknown or already used ticket")
        if time.monotonic() - grant.issued_at > TICKET_TTL_S:
            raise TicketRefused(f"ticket expired (good for {TICKET_TTL_S:.0f} s after Attach)")
        if grant.uid != uid:
            raise TicketRefused(f"ticket issued to uid {grant.uid}, presented by uid {uid}")
        if not grant.session_open():
            raise TicketRefused(f"session {grant.session_id[:8]} is closed")
        return grant.fd()

    # ------------------------------------------------------------------------------ connections

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            connection, _ = await loop.sock_accept(self._listening)
            task = loop.create_task(self._serve(connection))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _serve(self, connection: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        peer_token = secrets.token_hex(16)
        with connection:
            connection.setblocking(False)
            _, uid, _ = _PEERCRED.unpack(connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
            self._peers[peer_token] = uid
            try:
                await loop.sock_sendall(connection, f"{GREETING}{peer_token}\n".encode())
                line = await asyncio.wait_for(_read_line(loop, connection), LINE_TIMEOUT_S)
                if line is None:
                    return  # closed by the client (it did not need the descriptor)
                try:
                    if not line.startswith(TICKET_PREFIX):
                        raise TicketRefused(f"expected '{TICKET_PREFIX}<TICKET>'")
                    fd = self.redeem(line[len(TICKET_PREFIX):].strip(), uid)
                except TicketRefused as refused:
                    self.num_refused += 1
                    log.warning("fd socket: refused uid %d: %s", uid, refused)
                    await loop.sock_sendall(connection, f"{REFUSED_PREFIX}{refused}\n".encode())
                    return
                await _send_with_fd(loop, connection, f"{OK_LINE}\n".encode(), fd)
                self.num_sent_fds += 1
            except (OSError, asyncio.TimeoutError):
                return
            finally:
                del self._peers[peer_token]


async def _read_line(loop: asyncio.AbstractEventLoop, connection: socket.socket) -> str | None:
    """One line (without its newline; cut at MAX_LINE_BYTES), or None at end of stream."""
    data = b""
    while b"\n" not in data and len(data) <= MAX_LINE_BYTES:
        chunk = await loop.sock_recv(connection, MAX_LINE_BYTES)
        if not chunk:
            return None
        data += chunk
    return data.split(b"\n", 1)[0][:MAX_LINE_BYTES].decode("ascii", errors="replace")


async def _send_with_fd(loop: asyncio.AbstractEventLoop, connection: socket.socket, data: bytes, fd: int) -> None:
    """sendmsg with one descriptor; waits for room on the loop (a few bytes: at once in practice)."""
    while True:
        try:
            socket.send_fds(connection, [data], [fd])
            return
        except BlockingIOError:
            ready = loop.create_future()
            loop.add_writer(connection.fileno(), lambda: ready.done() or ready.set_result(None))
            try:
                await ready
            finally:
                loop.remove_writer(connection.fileno())
