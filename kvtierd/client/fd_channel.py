"""The client's end of the daemon's fd socket (protocol: kvtierd/wire/fd_passing.py).

`FdChannel.connect` opens `<socket>.fds` and reads the peer token that the Attach names
(AttachRequest.fd_peer); `receive_fd(ticket)` presents the Attach's one-time ticket and returns
the pool's descriptor, which the caller maps and closes. The pool is then never opened by name:
a runner under another uid than the daemon's maps it as long as the socket's group lets it
connect. Blocking, with a timeout; no torch, no grpc.
"""

from __future__ import annotations

import os
import socket

from kvtierd.errors import FailedPrecondition, PermissionDenied, Unavailable
from kvtierd.wire.fd_passing import GREETING, MAX_LINE_BYTES, OK_LINE, REFUSED_PREFIX, TICKET_PREFIX, fd_socket_path

FD_CHANNEL_TIMEOUT_S = 10.0


class FdChannel:
    """One open connection to the fd socket at `path`; `peer_token` is its greeting's token."""

    def __init__(self, path: str, connection: socket.socket, peer_token: str) -> None:
        self.path = path
        self.peer_token = peer_token
        self._connection = connection

    @classmethod
    def connect(cls, socket_path: str, timeout_s: float = FD_CHANNEL_TIMEOUT_S) -> FdChannel:
        """Connect to the fd socket of the daemon serving on the unix socket `socket_path`."""
        path = fd_socket_path(socket_path)
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        connection.settimeout(timeout_s)
        try:
            connection.connect(path)
            greeting = _read_line(connection, path)
        except PermissionError:
            connection.close()
            raise PermissionDenied(f"permission denied connecting to kvtierd's fd socket {path} as uid {os.getuid()}: "
                                   "the daemon's server.socket_group and socket_mode decide who may attach") from None
        except (FileNotFoundError, ConnectionRefusedError):
            connection.close()
            raise Unavailable(f"kvtierd's fd socket {path} is not there (is the daemon at unix://{socket_path} "
                              "running, and a version that passes the pool by descriptor?)") from None
        except BaseException:
            connection.close()
            raise
        if not greeting.startswith(GREETING):
            connection.close()
            raise FailedPrecondition(f"{path} is not a kvtierd fd socket (it said {greeting[:40]!r})")
        return cls(path, connection, greeting[len(GREETING):].strip())

    def receive_fd(self, ticket: str) -> int:
        """Present `ticket`; the pool's descriptor (the caller closes it), or PermissionDenied with
        the daemon's one-line reason."""
        self._connection.sendall(f"{TICKET_PREFIX}{ticket}\n".encode())
        data, fds = b"", []
        while b"\n" not in data:
            chunk, chunk_fds, _, _ = socket.recv_fds(self._connection, MAX_LINE_BYTES, 1)
            fds += chunk_fds
            if not chunk:
                break
            data += chunk
        line = data.split(b"\n", 1)[0].decode("ascii", errors="replace")
        if line == OK_LINE and len(fds) == 1:
            return fds[0]
        for fd in fds:
            os.close(fd)
        if line.startswith(REFUSED_PREFIX):
            raise PermissionDenied(f"kvtierd's fd socket {self.path} refused the pool: {line[len(REFUSED_PREFIX):]}")
        raise FailedPrecondition(f"kvtierd's fd socket {self.path} sent no descriptor (it said {line[:60]!r})")

    def close(self) -> None:
        self._connection.close()

    def __enter__(self) -> FdChannel:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _read_line(connection: socket.socket, path: str) -> str:
    data = b""
    while b"\n" not in data and len(data) <= MAX_LINE_BYTES:
        chunk = connection.recv(MAX_LINE_BYTES)
        if not chunk:
            break
        data += chunk
    return data.split(b"\n", 1)[0].decode("ascii", errors="replace")
