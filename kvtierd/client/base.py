"""What the sync and asyncio clients share: the daemon's address, channel options, deadlines and
retries, the mapping of gRPC errors onto kvtierd.errors. The requests and results of the calls
they make are calls.py's.

Retry policy: a call is retried on UNAVAILABLE only (the daemon could not be reached), with
exponential backoff (50 ms, 100 ms, 200 ms … capped at 1 s, jittered), at most `max_attempts`
attempts, and never past the call's overall deadline. Every other code is final. Streams are
retried only before any data has flowed (Get before its first message; Put and KeepAlive never:
their requests may come from a one-shot iterator), except Events, which resumes after the last
event it delivered (EventsRequest.resume_after_seq; a LOST event says what the daemon no longer held).

No call waits for a channel to become ready (no `wait_for_ready`): a daemon that is down fails
every attempt at once, so the caller gets Unavailable in well under a second, not at the deadline.
"""

from __future__ import annotations

import dataclasses
import os
import random
import time
from types import ModuleType
from typing import Any

import grpc

from kvtierd.client.fd_channel import FdChannel
from kvtierd.endpoints import default_socket_path
from kvtierd.errors import (
    DRAINING_DETAILS,
    ERRORS_BY_CODE,
    FailedPrecondition,
    InvalidArgument,
    KvtierError,
    PermissionDenied,
    Unavailable,
)
from kvtierd.v1 import kvtier_pb2 as pb
from kvtierd.v1 import kvtier_pb2_grpc
from kvtierd.wire.block_frames import decode_get_response
from kvtierd.wire.conversions import READ_CHUNK_OPTIONS
from kvtierd.wire.fd_passing import fd_socket_path

PUT_METHOD = "/kvtierd.v1.KvTier/Put"
GET_METHOD = "/kvtierd.v1.KvTier/Get"
RETRY_BASE_S = 0.05
RETRY_CAP_S = 1.0
EVENTS_RETRY_WINDOW_S = 5.0  # how long Events retries UNAVAILABLE, from its start or its last event


@dataclasses.dataclass(frozen=True, slots=True)
class TlsOptions:
    """PEM bytes for a TLS channel; all None uses the system roots and no client certificate."""

    root_ca: bytes | None = None
    cert_chain: bytes | None = None
    private_key: bytes | None = None

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self.root_ca, private_key=self.private_key,
                                            certificate_chain=self.cert_chain)


def default_target() -> str:
    """KVTIERD_ADDRESS if set, else the daemon's default unix socket."""
    address = os.environ.get("KVTIERD_ADDRESS")
    if address:
        return address
    return "unix://" + default_socket_path()


def unix_socket_path(target: str) -> str | None:
    """The socket path of a "unix:///abs" or "unix:path" target; None for host:port."""
    for prefix in ("unix://", "unix:"):
        if target.startswith(prefix):
            return target[len(prefix):]
    return None


def bearer_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """The metadata sent on every call: the bearer token (argument, else KVTIERD_TOKEN), if any."""
    if token is None:
        token = os.environ.get("KVTIERD_TOKEN")
    return (("authorization", f"Bearer {token}"),) if token else ()


def channel_options(target: str, max_message_bytes: int) -> list[tuple[str, Any]]:
    options: list[tuple[str, Any]] = [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        # Reconnect soon after a daemon restart, so that retries can reach it.
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 2000),
        *READ_CHUNK_OPTIONS,
    ]
    if unix_socket_path(target) is not None:
        options.append(("grpc.default_authority", "localhost"))
    return options


def socket_denied_message(path: str) -> str:
    return (f"permission denied reaching kvtierd's socket {path} as uid {os.getuid()}: the daemon's "
            "server.socket_group and socket_mode decide who may attach (be in that group)")


def unavailable_message(target: str, details: str) -> str:
    path = unix_socket_path(target)
    if path is not None and ("Permission denied" in details or _search_denied(path)):
        return f"kvtierd at {target}: {socket_denied_message(path)}"
    if path is not None and not os.path.exists(path):
        return (f"kvtierd is not running at {target}: the socket {path} does not exist ({details}). "
                "Start the daemon with `kvtierd serve`, or set KVTIERD_ADDRESS to where it listens.")
    if details.startswith(DRAINING_DETAILS):  # the daemon answered: no connection problem to hint at
        return f"kvtierd at {target}: {details}"
    return (f"kvtierd at {target} is unavailable ({details}). "
            "Is the daemon running? Start it with `kvtierd serve`.")


def _search_denied(path: str) -> bool:
    """Whether `path` cannot be looked up for want of search permission on its directory."""
    try:
        os.stat(path)
    except PermissionError:
        return True
    except OSError:
        return False
    return False


def map_rpc_error(error: grpc.RpcError, target: str) -> KvtierError:
    """The KvtierError of an RpcError's status code, keeping the server's details text."""
    code = error.code()
    details = error.details() or ""
    if code == grpc.StatusCode.UNAVAILABLE:
        return Unavailable(unavailable_message(target, details))
    cls = ERRORS_BY_CODE.get(code.name)
    if cls is None:
        mapped = KvtierError(f"{code.name}: {details}")
        mapped.code = code.name
        return mapped
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return cls(f"{details} (kvtierd at {target})")
    return cls(details)


class Retry:
    """The deadline and backoff of one call (see the module docstring)."""

    def __init__(self, max_attempts: int, timeout_s: float) -> None:
        self.max_attempts = max_attempts
        self.deadline = time.monotonic() + timeout_s
        self.num_attempts = 1

    def remaining_s(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    def next_delay(self, code: grpc.StatusCode) -> float | None:
        """Seconds to sleep before the next attempt, or None when the error is final."""
        if code != grpc.StatusCode.UNAVAILABLE or self.num_attempts >= self.max_attempts:
            return None
        delay = min(RETRY_CAP_S, RETRY_BASE_S * 2 ** (self.num_attempts - 1)) * random.uniform(0.75, 1.25)
        if time.monotonic() + delay >= self.deadline:
            return None
        self.num_attempts += 1
        return delay


class ClientBase:
    """What the blocking and the asyncio client share: the target, the credentials, the limits
    and the channel (`channels` is the module making it: `grpc` or `grpc.aio`)."""

    def __init__(self, channels: ModuleType, target: str | None, token: str | None, tls: TlsOptions | None,
                 timeout_s: float, max_attempts: int, max_message_bytes: int) -> None:
        if not timeout_s > 0 or max_attempts < 1:
            raise InvalidArgument(f"need timeout_s > 0 and max_attempts >= 1, got {timeout_s}, {max_attempts}")
        self.target = target or default_target()
        self.timeout_s = timeout_s
        self.max_attempts = max_attempts
        self.closed = False
        self._metadata = bearer_metadata(token)
        options = channel_options(self.target, max_message_bytes)
        self._channel = (channels.insecure_channel(self.target, options=options) if tls is None
                         else channels.secure_channel(self.target, tls.credentials(), options=options))
        self._stub = kvtier_pb2_grpc.KvTierStub(self._channel)
        # Put and Get move block bytes: serialized by block_frames.py, not through protobuf objects
        self._put = self._channel.stream_unary(PUT_METHOD, request_serializer=None,
                                               response_deserializer=pb.PutResponse.FromString)
        self._get = self._channel.unary_stream(GET_METHOD, request_serializer=pb.GetRequest.SerializeToString,
                                               response_deserializer=decode_get_response)
        self._sessions: set = set()  # open sessions; close() closes them

    def _check_open(self) -> None:
        if self.closed:
            raise FailedPrecondition(f"the client of {self.target} is closed")

    def _fd_channel(self) -> FdChannel | None:
        """A connection to the daemon's fd socket, to map the pool by descriptor; None where there is
        none to make: a TCP target, or no `<socket>.fds` (a daemon that predates it, or one that is
        down: the Attach then says so). PermissionDenied when the socket's group and mode refuse us."""
        path = unix_socket_path(self.target)
        if path is None:
            return None
        try:
            os.stat(fd_socket_path(path))
        except FileNotFoundError:
            return None
        except PermissionError:
            raise PermissionDenied(socket_denied_message(path)) from None
        return FdChannel.connect(path)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.target!r}{', closed' if self.closed else ''})"


class EventStreamBase:
    """What the blocking and asyncio event streams share: the call, and its retry: UNAVAILABLE is
    retried like a unary call, and once an event has arrived the new call resumes after it
    (`last_seq`, `feed_id`: pass them to `events()` to resume in another process)."""

    def __init__(self, client: ClientBase, request: pb.EventsRequest, timeout_s: float | None) -> None:
        self._client = client
        self._request = request
        self._timeout_s = timeout_s
        self.last_seq: int | None = request.resume_after_seq if request.HasField("resume_after_seq") else None
        self.feed_id = request.feed_id
        self._retry = Retry(client.max_attempts, EVENTS_RETRY_WINDOW_S)
        self._cancelled = False
        self._call = self._open()

    def _open(self):
        request = pb.EventsRequest()
        request.CopyFrom(self._request)
        if self.last_seq is not None:
            request.resume_after_seq, request.feed_id = self.last_seq, self.feed_id
        return self._client._stub.Events(request, timeout=self._timeout_s, metadata=self._client._metadata)

    def _delivered(self, event: pb.Event) -> pb.Event:
        """Note where the stream is; a later outage gets a retry budget of its own."""
        self.last_seq, self.feed_id = event.seq, event.feed_id
        self._retry = Retry(self._client.max_attempts, EVENTS_RETRY_WINDOW_S)
        return event
