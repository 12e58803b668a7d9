"""How the shared store's client talks to a node: redis-py connections that send large values
without copying them (pure-Python packing) and read many small replies straight off the socket
(hiredis, when installed)."""

from __future__ import annotations

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
