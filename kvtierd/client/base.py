"""What the sync and asyncio clients share: the daemon's address, channel options, deadlines and
retries, the mapping of gRPC errors onto kvtierd.errors, and the building of requests and results.

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
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import grpc

from kvtierd.block_hash import Namespace
from kvtierd.client.block_data import TokenIds, hash_list, optional_tokens
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
from kvtierd.layout import Layout
from kvtierd.v1 import kvtier_pb2 as pb
from kvtierd.v1 import kvtier_pb2_grpc
from kvtierd.wire.block_frames import decode_get_response
from kvtierd.wire.conversions import READ_CHUNK_OPTIONS, handle_from_proto, layout_to_proto
from kvtierd.wire.fd_passing import fd_socket_path

if TYPE_CHECKING:
    from kvtierd.t0.device_pool import DevicePool

PUT_METHOD = "/kvtierd.v1.KvTier/Put"
GET_METHOD = "/kvtierd.v1.KvTier/Get"
RETRY_BASE_S = 0.05
RETRY_CAP_S = 1.0
WAIT_MARGIN_S = 1.0  # Wait's RPC deadline is the daemon-side timeout plus this
ATTACH_TIMEOUT_S = 60.0  # the least deadline of an Attach (see attach_call)
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


@dataclasses.dataclass(frozen=True, slots=True)
class AcquireResult:
    """A request's block table from Acquire: hits first (loads pending if `pending`), then fresh."""

    block_ids: list[int]
    num_t0_hit_blocks: int
    num_t1_blocks: int
    num_t2_blocks: int
    pending: bool
    num_t3_blocks: int = 0  # being loaded from the shared store: Wait says how many landed

    @property
    def num_loading_blocks(self) -> int:
        """Blocks after the T0 hits being loaded from the lower tiers."""
        return self.num_t1_blocks + self.num_t2_blocks + self.num_t3_blocks


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


@dataclasses.dataclass(frozen=True, slots=True)
class Call:
    """One unary call: the stub method's name, its request, and how to read its response."""

    method: str
    request: Any
    parse: Callable[[Any], Any] = lambda response: response
    timeout_s: float | None = None  # None: the client's timeout_s


def attach_call(layout: Layout, hash_algo: str, timeout_s: float, deadline_s: float | None = None,
                fd_peer: str = "") -> Call:
    """Attach, with a deadline of `deadline_s`, else at least ATTACH_TIMEOUT_S: the first Attach of a
    layout builds its pool (device pool, host memory, SSD slot files), which takes seconds on a
    loaded node. `fd_peer`: the token of an open FdChannel, to get the pool by descriptor."""
    Namespace(layout, "", hash_algo)  # InvalidArgument for an unknown algorithm, before any call
    if deadline_s is not None and deadline_s <= 0:
        raise ValueError(f"an Attach deadline must be > 0 s, got {deadline_s}")
    return Call("Attach", pb.AttachRequest(layout=layout_to_proto(layout), hash_algo=hash_algo, fd_peer=fd_peer),
                timeout_s=max(timeout_s, ATTACH_TIMEOUT_S) if deadline_s is None else deadline_s)


def get_request(layout: Layout, block_hashes: Sequence[bytes], token_ids: TokenIds | None) -> pb.GetRequest:
    return pb.GetRequest(layout=layout_to_proto(layout), block_hashes=hash_list(block_hashes),
                         token_ids=optional_tokens(token_ids))


def events_request(layout: Layout | None, resume_after_seq: int | None = None, feed_id: int = 0) -> pb.EventsRequest:
    request = pb.EventsRequest() if layout is None else pb.EventsRequest(layout=layout_to_proto(layout))
    if resume_after_seq is not None:
        request.resume_after_seq = resume_after_seq
        request.feed_id = feed_id
    return request


OPERATION_TIMEOUT_S = 120.0  # Evict may copy a pool's worth of blocks down before it answers


def tenant_stats_call(tenant: str) -> Call:
    return Call("TenantStats", pb.TenantStatsRequest(tenant=tenant), lambda r: list(r.usage))


def evict_call(tenant: str, all_tenants: bool, tiers: Sequence[str], layout: Layout | None) -> Call:
    request = pb.EvictRequest(tenant=tenant, all_tenants=all_tenants, tiers=list(tiers))
    if layout is not None:
        request.layout.CopyFrom(layout_to_proto(layout))
    return Call("Evict", request, timeout_s=OPERATION_TIMEOUT_S)


def drain_call(resume: bool) -> Call:
    return Call("Drain", pb.DrainRequest(resume=resume))


class ClientBase:
    """What the blocking and the asyncio client share: the target, the credentials, the limits
    and the channel (`channels` is the module making it: `grpc` or `grpc.aio`)."""

    def __init__(self, channels, target: str | None, token: str | None, tls: TlsOptions | None,
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


class SessionBase:
    """The fields of an attached session and the calls it makes; Session and AsyncSession run them.

    Built from an AttachResponse after checking that daemon and client hash alike: the root the
    daemon reports must be this process's `Namespace(layout, "", hash_algo).root`.
    """

    def __init__(self, layout: Layout, response: pb.AttachResponse, hash_algo: str) -> None:
        self.namespace = Namespace(layout, tenant="", algo=hash_algo)
        if bytes(response.root_hash) != self.namespace.root:
            raise FailedPrecondition(
                f"daemon and client disagree on the hash root (hash_algo={hash_algo!r}, layout={layout}): "
                f"daemon {bytes(response.root_hash).hex()}, client {self.namespace.root.hex()}")
        if response.hash_size and response.hash_size != self.namespace.digest_size:
            raise FailedPrecondition(f"daemon and client disagree on the hash size: "
                                     f"{response.hash_size} != {self.namespace.digest_size}")
        self.session_id: str = response.session_id
        self.tenant: str = response.tenant
        self.layout = layout
        self.handle = handle_from_proto(response.pool, layout)
        self._fd_ticket: str = response.pool.fd_ticket  # one-time: the pool's descriptor on the fd socket
        self.pool: DevicePool | None = None  # mapped by the client when map_pool
        self.root_hash: bytes = self.namespace.root
        self.hash_size: int = self.namespace.digest_size
        self.bytes_per_block: int = response.bytes_per_block or layout.bytes_per_block
        self.lease_s: float = response.lease_s
        self.closed = False

    def keepalive_interval_s(self) -> float:
        return self.lease_s / 3 if self.lease_s > 0 else 10.0

    def map_pool(self, fd_channel: FdChannel | None = None) -> None:
        """Map the daemon's device pool into this process (`pool`); imports torch, only here.

        With the fd channel whose token the Attach named, the pool comes as a descriptor and no
        name is opened (any uid the socket lets in). Without (a TCP target, a daemon without an fd
        socket): an shm pool is opened by name, which only the daemon's uid may do."""
        from kvtierd.t0.factory import attach_device_pool

        if fd_channel is None or not self._fd_ticket:
            self.pool = attach_device_pool(self.handle)
            return
        fd = fd_channel.receive_fd(self._fd_ticket)
        self._fd_ticket = ""
        try:
            self.pool = attach_device_pool(self.handle, fd)
        finally:
            os.close(fd)

    def _lookup(self, block_hashes, token_ids, prefetch, chain_lengths, num_query_blocks: int) -> Call:
        return Call("Lookup", pb.LookupRequest(session_id=self.session_id, block_hashes=hash_list(block_hashes),
                                               token_ids=optional_tokens(token_ids), prefetch=prefetch,
                                               chain_lengths=list(chain_lengths or ()),
                                               num_query_blocks=num_query_blocks))

    def _acquire(self, request_id, block_hashes, num_extra_blocks, token_ids, for_store: bool,
                 query_counted: bool = False, parent_hash: bytes | None = None) -> Call:
        request = pb.AcquireRequest(session_id=self.session_id, request_id=request_id,
                                    block_hashes=hash_list(block_hashes), token_ids=optional_tokens(token_ids),
                                    num_extra_blocks=num_extra_blocks, for_store=for_store,
                                    query_counted=query_counted, parent_hash=bytes(parent_hash or b""))
        return Call("Acquire", request, lambda r: AcquireResult(list(r.block_ids), r.num_t0_hit_blocks,
                                                           r.num_t1_blocks, r.num_t2_blocks, r.pending,
                                                           r.num_t3_blocks))

    def _wait(self, request_id, timeout_s: float | None, default_timeout_s: float) -> Call:
        """The daemon waits `timeout_s` (None: the client's timeout); the RPC deadline adds a margin."""
        wait_s = default_timeout_s if timeout_s is None else timeout_s
        request = pb.WaitRequest(session_id=self.session_id, request_id=request_id, timeout_s=wait_s)
        return Call("Wait", request, lambda r: r.num_ready_blocks, timeout_s=wait_s + WAIT_MARGIN_S)

    def _commit(self, request_id, block_ids, block_hashes, token_ids, parent_hash) -> Call:
        request = pb.CommitRequest(session_id=self.session_id, request_id=request_id, block_ids=list(block_ids),
                                   block_hashes=hash_list(block_hashes), token_ids=optional_tokens(token_ids),
                                   parent_hash=bytes(self.root_hash if parent_hash is None else parent_hash))
        return Call("Commit", request, lambda r: r.num_committed_blocks)

    def _release(self, request_id) -> Call:
        return Call("Release", pb.ReleaseRequest(session_id=self.session_id, request_id=request_id),
                    lambda r: r.num_released_blocks)

    def _fork(self, request_id, child_request_id) -> Call:
        request = pb.ForkRequest(session_id=self.session_id, request_id=request_id,
                                 child_request_id=child_request_id)
        return Call("Fork", request, lambda r: list(r.block_ids))

    def _append_blocks(self, request_id, num_blocks) -> Call:
        request = pb.AppendBlocksRequest(session_id=self.session_id, request_id=request_id, num_blocks=num_blocks)
        return Call("AppendBlocks", request, lambda r: list(r.block_ids))

    def _prepare_write(self, request_id, position) -> Call:
        request = pb.PrepareWriteRequest(session_id=self.session_id, request_id=request_id, position=position)
        return Call("PrepareWrite", request, lambda r: (r.block_id, r.copied))

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"lease_s={self.lease_s}"
        return f"{type(self).__name__}({self.session_id!r}, tenant={self.tenant!r}, {self.layout.model_id!r}, {state})"


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
