"""How the shared store's client talks to a node: redis-py connections that send large values
without copying them (pure-Python packing) and read many small replies straight off the socket
(hiredis, when installed)."""

from __future__ import annotations

import numpy as np
import redis
from redis.connection import PythonRespSerializer

try:
    import hiredis
except ImportError:  # a dependency, but redis-py works without it
    hiredis = None

HIREDIS = hiredis is not None


def read_replies(connection: redis.Connection, num_replies: int) -> list:
    """`num_replies` replies read off the connection's socket (its timeout applies) by a hiredis
    Reader; an error reply becomes redis-py's exception for it (MOVED: MovedError, ...)."""
    assert hiredis is not None and connection._sock is not None  # HIREDIS; a connection _send wrote to
    reader = hiredis.Reader()
    replies: list = []
    sock = connection._sock
    while len(replies) < num_replies:
        data = sock.recv(1 << 16)
        if not data:
            raise redis.ConnectionError(f"{connection.host}:{connection.port} closed the connection")
        reader.feed(data)
        while (reply := reader.gets()) is not False:
            replies.append(reply)
    return [connection._parser.parse_error(str(reply)) if isinstance(reply, hiredis.ReplyError) else reply
            for reply in replies]


def _python_packer(base: type[redis.Connection]) -> type[redis.Connection]:
    """`base` packing commands in Python: a value over redis-py's buffer cutoff (6,000 bytes) is
    sent as it is, where hiredis' packer (redis-py's default once hiredis is installed) copies
    every 2 MiB value into one buffer. Replies are still parsed by hiredis when installed.
    Measured on a loopback 3-master cluster, 64 x 2 MiB (benchmarks/bench_redis_clients.py):
    SET 1.01-1.15x the pure-Python client with this packer, 0.77-0.82x with hiredis' packer;
    GET 1.9-2.5x with hiredis parsing."""

    class PythonPackerConnection(base):
        def _construct_command_packer(self, packer):
            return packer if packer is not None else PythonRespSerializer(self._buffer_cutoff, self.encoder.encode)

    PythonPackerConnection.__name__ = f"PythonPacker{base.__name__}"
    return PythonPackerConnection


CONNECTION = _python_packer(redis.Connection)
TLS_CONNECTION = _python_packer(redis.SSLConnection)


class BulkReader:
    """Replies to pipelined GETs read off a connection's socket, each value received straight into
    a buffer of its own (`recv_into`: no copy besides the kernel's; hiredis copies a 2 MiB value
    twice, into its reader and then into a bytes). A value is a memoryview of its own buffer (a
    numpy array, not zeroed first; the view compares equal to the bytes it holds); a nil is None;
    an error reply is redis-py's exception for it (MOVED: MovedError, ...). Only the replies GET
    gives ($ bulk, $-1 or RESP3's _ nil, - error) are expected; any other is a protocol error. The socket's
    timeout applies to every receive.
    Measured on a loopback 3-master cluster, 64 x 2 MiB (benchmarks/bench_redis_clients.py)."""

    HEAD_BYTES = 1 << 16

    def __init__(self, connection: redis.Connection) -> None:
        assert connection._sock is not None  # connected: the GETs were just written to it
        self.connection = connection
        self.sock = connection._sock
        self.head = bytearray(self.HEAD_BYTES)
        self.start = self.end = 0  # unread bytes: head[start:end]

    def read(self, num_replies: int) -> list:
        return [self._reply() for _ in range(num_replies)]

    def _reply(self):
        line = self._line()
        kind, rest = line[:1], line[1:]
        if kind == b"$":
            length = int(rest)
            return None if length < 0 else self._bulk(length)
        if kind == b"_":  # RESP3's null (redis-py 8 speaks RESP3 where the server does)
            return None
        if kind == b"-":
            return self.connection._parser.parse_error(rest.decode(errors="replace"))
        raise redis.InvalidResponse(f"unexpected reply to GET: {line[:32]!r}")

    def _line(self) -> bytes:
        """The next line, without its CRLF."""
        while True:
            at = self.head.find(b"\r\n", self.start, self.end)
            if at >= 0:
                line = bytes(self.head[self.start:at])
                self.start = at + 2
                return line
            if self.start == 0 and self.end == len(self.head):
                raise redis.InvalidResponse("a reply line longer than 64 KiB")
            self._fill()

    def _bulk(self, length: int) -> memoryview:
        view = np.empty(length, np.uint8).data
        buffered = min(length, self.end - self.start)
        view[:buffered] = self.head[self.start:self.start + buffered]
        self.start += buffered
        received = buffered
        while received < length:
            n = self.sock.recv_into(view[received:])
            if not n:
                raise redis.ConnectionError(f"{self.connection.host}:{self.connection.port} closed the connection")
            received += n
        while self.end - self.start < 2:  # the value's CRLF
            self._fill()
        self.start += 2
        return view

    def _fill(self) -> None:
        """Receive more into the head buffer, its unread bytes moved to the front first."""
        if self.start:
            unread = self.end - self.start
            self.head[:unread] = self.head[self.start:self.end]
            self.start, self.end = 0, unread
        n = self.sock.recv_into(memoryview(self.head)[self.end:])
        if not n:
            raise redis.ConnectionError(f"{self.connection.host}:{self.connection.port} closed the connection")
        self.end += n
