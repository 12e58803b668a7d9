"""BulkReader parses pipelined GET replies off a real socket (a socketpair), however the bytes are
split across receives: values exact (also ones longer than its head buffer), RESP2 and RESP3 nils,
error replies as redis-py's exceptions, and a closed peer as a ConnectionError."""

from __future__ import annotations

import random
import socket
import threading

import pytest
import redis

from kvtierd.t3.redis_connections import BulkReader


def replies_over_socket(payload: bytes, num_replies: int, seed: int) -> list:
    """Read `num_replies` replies while another thread sends `payload` in random pieces (1 B to 70 KiB)."""
    ours, theirs = socket.socketpair()
    theirs.settimeout(10)  # a reader that stops early leaves the sender stuck: fail instead
    connection = redis.Connection()
    connection._sock = ours
    rng = random.Random(seed)

    def send() -> None:
        at = 0
        try:
            while at < len(payload):
                size = rng.choice([1, 2, 3, 7, 100, 4096, 70_000])
                theirs.sendall(payload[at:at + size])
                at += size
        finally:
            theirs.close()

    sender = threading.Thread(target=send)
    sender.start()
    try:
        return BulkReader(connection).read(num_replies)
    finally:
        sender.join()
        ours.close()


def bulk(value: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(value), value)


@pytest.mark.parametrize("seed", range(5))
def test_values_nils_and_errors_come_back_in_order_however_the_bytes_are_split(seed):
    rng = random.Random(seed)
    values = [rng.randbytes(rng.choice([0, 1, 5, 65_535, 65_536, 200_000, 2 << 20])) for _ in range(8)]
    payload = (bulk(values[0]) + b"$-1\r\n" + bulk(values[1]) + b"_\r\n" + b"-MOVED 3999 127.0.0.1:6381\r\n"
               + b"".join(bulk(v) for v in values[2:]))
    replies = replies_over_socket(payload, 11, seed)
    assert replies[0] == values[0] and replies[1] is None and replies[2] == values[1] and replies[3] is None
    assert isinstance(replies[4], redis.exceptions.MovedError) and "3999" in str(replies[4])
    assert [bytes(r) for r in replies[5:]] == values[2:]


def test_a_peer_that_closes_mid_value_is_a_connection_error():
    with pytest.raises(redis.ConnectionError):
        replies_over_socket(b"$10\r\nabc", 1, 0)


def test_a_reply_get_never_gives_is_a_protocol_error():
    with pytest.raises(redis.InvalidResponse):
        replies_over_socket(b":1\r\n", 1, 0)
