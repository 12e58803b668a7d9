"""The fd socket: how a runner receives the device pool's file descriptor (SCM_RIGHTS).

gRPC cannot carry file descriptors, so the daemon listens on a second unix socket beside its gRPC
socket, `<socket>.fds` (same group and mode). One connection, lines of ASCII ending in "\\n":

    daemon → client   "kvtierd-fd 1 peer <PEER>"      on accept; PEER names this connection, whose
                                                       uid the daemon read from SO_PEERCRED
    (the client calls Attach with fd_peer = PEER; the daemon binds the session's one-time ticket
     to that uid and returns it in AttachResponse.pool.fd_ticket)
    client → daemon   "ticket <TICKET>"
    daemon → client   "ok"  with the pool's descriptor attached (SCM_RIGHTS), then closes
                  or  "refused: <reason>"  with no descriptor, then closes

A ticket is good once, for the session it was issued to, presented by the uid it was bound to,
within TICKET_TTL_S. No KV byte crosses this socket.
"""

from __future__ import annotations

FD_SOCKET_SUFFIX = ".fds"
GREETING = "kvtierd-fd 1 peer "
TICKET_PREFIX = "ticket "
OK_LINE = "ok"
REFUSED_PREFIX = "refused: "
MAX_LINE_BYTES = 256
TICKET_TTL_S = 60.0  # an Attach's ticket is dropped when not presented within this
LINE_TIMEOUT_S = 30.0  # a connection that sends no complete line within this is closed


def fd_socket_path(socket_path: str) -> str:
    """The fd socket beside the gRPC unix socket `socket_path`."""
    return socket_path + FD_SOCKET_SUFFIX
