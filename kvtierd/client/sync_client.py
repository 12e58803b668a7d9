"""The blocking client of kvtierd: `KvtierClient` and `Session`; `AsyncKvtierClient` (asyncio,
aio_client.py) has the same surface.

    with KvtierClient() as client:                  # KVTIERD_ADDRESS, else the default socket
        session = client.attach(layout)             # maps the pool, keeps the lease alive
        acquired = session.acquire("req-1", hashes, num_extra_blocks=1)
        ...
        session.release("req-1")

Every call has a deadline and fails with a kvtierd.errors.KvtierError (the original
grpc.RpcError as its __cause__); a daemon that is down gives Unavailable at once. Retries,
deadlines (base.py) and request building (calls.py) are shared with the async client.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TypeVar

import grpc

from kvtierd.chain_lookup import ChainLookup
from kvtierd.client.base import ClientBase, EventStreamBase, Retry, TlsOptions, map_rpc_error
from kvtierd.client.block_data import BlockData, PutResult, PutStream, TokenIds
from kvtierd.client.calls import (
    AcquireResult,
    Call,
    CommitResult,
    SessionBase,
    attach_call,
    drain_call,
    events_request,
    evict_call,
    forget_call,
    get_request,
    retain_call,
    tenant_stats_call,
)
from kvtierd.errors import FailedPrecondition
from kvtierd.layout import Layout
from kvtierd.v1 import kvtier_pb2 as pb

log = logging.getLogger(__name__)
T = TypeVar("T")
KEEPALIVE_CLOSE_GRACE_S = 0.5  # after half-closing KeepAlive, how long the daemon may take to end it


class KvtierClient(ClientBase):
    """A channel to one daemon; thread-safe. `close()` ends its sessions, streams and channel."""

    def __init__(self, target: str | None = None, *, token: str | None = None, tls: TlsOptions | None = None,
                 timeout_s: float = 5.0, max_attempts: int = 4, max_message_bytes: int = 16 << 20) -> None:
        super().__init__(grpc, target, token, tls, timeout_s, max_attempts, max_message_bytes)

    def _retrying(self, attempt: Callable[[float], T], timeout_s: float | None) -> T:
        """Run `attempt(seconds_left)`, retrying UNAVAILABLE per the policy of base.Retry."""
        self._check_open()
        retry = Retry(self.max_attempts, self.timeout_s if timeout_s is None else timeout_s)
        while True:
            try:
                return attempt(retry.remaining_s())
            except grpc.RpcError as error:
                delay = retry.next_delay(error.code())
                if delay is None:
                    raise map_rpc_error(error, self.target) from error
            time.sleep(delay)

    def _run(self, call: Call):
        method = getattr(self._stub, call.method)
        return call.parse(self._retrying(
            lambda timeout: method(call.request, timeout=timeout, metadata=self._metadata), call.timeout_s))

    def attach(self, layout: Layout, *, map_pool: bool = True, hash_algo: str = "sha256",
               keepalive: bool = True, deadline_s: float | None = None) -> Session:
        """Open a session for `layout`; FailedPrecondition if the daemon hashes differently.
        `deadline_s` bounds the call (default: the client's timeout, at least ATTACH_TIMEOUT_S)."""
        fd_channel = self._fd_channel() if map_pool else None
        try:
            response = self._run(attach_call(layout, hash_algo, self.timeout_s, deadline_s,
                                             fd_channel.peer_token if fd_channel else ""))
            session = Session(self, layout, response, hash_algo)
            try:
                if map_pool:
                    session.map_pool(fd_channel)
                if keepalive:
                    session._keepalive = KeepAlive(self, session)
            except BaseException:
                session.close()
                raise
        finally:
            if fd_channel is not None:
                fd_channel.close()
        self._sessions.add(session)
        return session

    def put(self, layout: Layout, blocks: Iterable[tuple[bytes, TokenIds, BlockData]],
            parent_hash: bytes | None = None, *, timeout_s: float | None = None) -> PutResult:
        """Store a chain of blocks (chain order, from the block after `parent_hash`). Not retried."""
        if self.closed:
            raise FailedPrecondition(f"the client of {self.target} is closed")
        stream = PutStream(layout, blocks, parent_hash)
        try:
            response = self._put(stream.requests(), metadata=self._metadata,
                                      timeout=self.timeout_s if timeout_s is None else timeout_s)
        except grpc.RpcError as error:
            if stream.error is not None:
                raise stream.error from None
            raise map_rpc_error(error, self.target) from error
        return stream.result(response)

    def get(self, layout: Layout, block_hashes: Sequence[bytes], token_ids: TokenIds | None = None, *,
            timeout_s: float | None = None) -> list[tuple[bytes, bytes]]:
        """(hash, data) of the leading cached blocks of the chain, in chain order."""
        request = get_request(layout, block_hashes, token_ids)

        def attempt(timeout: float) -> list[tuple[bytes, bytes]]:
            blocks: list[tuple[bytes, bytes]] = []
            try:
                for block in self._get(request, timeout=timeout, metadata=self._metadata):
                    blocks.append(block)  # (hash, data), decoded by block_frames.decode_get_response
            except grpc.RpcError as error:
                if blocks:  # data has flowed: no retry
                    raise map_rpc_error(error, self.target) from error
                raise
            return blocks

        return self._retrying(attempt, timeout_s)

    def stats(self) -> pb.StatsResponse:
        return self._run(Call("Stats", pb.StatsRequest()))

    def retain(self, layout: Layout, block_hashes: Sequence[bytes], hint: pb.RetentionHint | None = None, *,
               action: pb.RetainRequest.Action = pb.RetainRequest.RETAIN,
               token_ids: TokenIds | None = None) -> pb.RetainResponse:
        """Keep the caller's cached blocks of a chain through a pause (RETAIN `hint`), stop keeping them
        (RELEASE `hint.retention_session`'s hints; no hashes: on every block), or bring them up towards
        T0 (PREFETCH, and RETAIN when `hint` is given). No session: `layout` names the pool."""
        return self._run(retain_call(layout, action, block_hashes, hint, token_ids))

    def tenant_stats(self, tenant: str = "") -> list[pb.TenantUsage]:
        """Usage per pool of the caller ("") or a tenant; "*" = every tenant (admin)."""
        return self._run(tenant_stats_call(tenant))

    def evict(self, tenant: str = "", *, all_tenants: bool = False, tiers: Sequence[str] = (),
              layout: Layout | None = None) -> pb.EvictResponse:
        """Drop unheld cached blocks from `tiers` (none: all three, a flush); see the Evict rpc."""
        return self._run(evict_call(tenant, all_tenants, tiers, layout))

    def forget(self, tenant: str) -> pb.ForgetResponse:
        """Admin: destroy the tenant's data key and drop its unheld blocks from every tier; see the Forget rpc."""
        return self._run(forget_call(tenant))

    def drain(self, resume: bool = False) -> pb.DrainResponse:
        return self._run(drain_call(resume))

    def events(self, layout: Layout | None = None, *, timeout_s: float | None = None,
               resume_after_seq: int | None = None, feed_id: int = 0) -> EventStream:
        """The tenant's device-tier events until `.cancel()`, `close()` or `timeout_s` (None: no end):
        new ones, or those after `resume_after_seq` of feed `feed_id` (an earlier stream's `last_seq`
        and `feed_id`), with a LOST event first when the daemon no longer holds some of them."""
        if self.closed:
            raise FailedPrecondition(f"the client of {self.target} is closed")
        return EventStream(self, events_request(layout, resume_after_seq, feed_id), timeout_s)

    def close(self) -> None:
        """Close every session of this client, then the channel (ending its streams). Idempotent."""
        for session in list(self._sessions):
            session.close()
        self.closed = True
        self._channel.close()

    def __enter__(self) -> KvtierClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class Session(SessionBase):
    """One session of a KvtierClient (see SessionBase for its fields). `close()` ends the lease:
    the daemon then reclaims every block the session's requests still hold. A session that is
    never closed lives until its client closes."""

    def __init__(self, client: KvtierClient, layout: Layout, response: pb.AttachResponse, hash_algo: str) -> None:
        super().__init__(layout, response, hash_algo)
        self._client = client
        self._keepalive: KeepAlive | None = None

    @property
    def client(self) -> KvtierClient:
        """The client this session was attached through (Put and Get, which need no session)."""
        return self._client

    def lookup(self, block_hashes: Sequence[bytes], token_ids: TokenIds | None = None,
               prefetch: bool = False, chain_lengths: Sequence[int] | None = None,
               num_query_blocks: int = 0, hold_id: str = "") -> ChainLookup:
        """The leading blocks held of the chain, tier by tier (`.hits[0]`); with `chain_lengths`, of
        each of the consecutive chains `block_hashes` holds (`.hits[i]`), each matched on its own
        (`.total`: all added up). `num_query_blocks`: count the first chain's leading blocks as one
        query of the daemon's hit rate, its hits as answered (less the declined ones) tier by tier.
        `.declined[i]`: the chain's trailing hits slower to load than to recompute (`.kept[i]`: the rest).
        `hold_id`: hold the first chain's promised T0 and T1 blocks until an Acquire names it (5 s at most)."""
        return self._client._run(self._lookup(block_hashes, token_ids, prefetch, chain_lengths, num_query_blocks,
                                              hold_id))

    def acquire(self, request_id: str, block_hashes: Sequence[bytes], num_extra_blocks: int = 0,
                token_ids: TokenIds | None = None, for_store: bool = False, query_counted: bool = False,
                parent_hash: bytes | None = None, recompute_s_per_token: float = 0.0,
                load_every_hit: bool = False, hold_id: str = "") -> AcquireResult:
        """`for_store`: the caller acquires to store blocks it computed; what it finds is no hit.
        `query_counted`: a Lookup counted the query and its hits (num_query_blocks): count nothing.
        `parent_hash`: the chain continues the block of that hash (None: it starts at the root).
        `recompute_s_per_token`: the caller's measured cost of a prompt token (0: not measured),
        which the daemon weighs lower-tier hits against; `load_every_hit`: a Lookup decided what
        to load (these blocks), load them whatever the cost; `hold_id`: the Lookup's hold to give back."""
        return self._client._run(self._acquire(request_id, block_hashes, num_extra_blocks, token_ids, for_store,
                                               query_counted, parent_hash, recompute_s_per_token, load_every_hit,
                                               hold_id))

    def wait(self, request_id: str, timeout_s: float | None = None) -> int:
        """Leading ready blocks once loads land; the daemon waits `timeout_s` (None: the client's)."""
        return self._client._run(self._wait(request_id, timeout_s, self._client.timeout_s))

    def commit(self, request_id: str, block_ids: Sequence[int], block_hashes: Sequence[bytes],
               token_ids: TokenIds, parent_hash: bytes | None) -> int:
        """Blocks committed; parent_hash None means the chain's root."""
        return self._client._run(self._commit(request_id, block_ids, block_hashes, token_ids, parent_hash))

    def commit_and_release(self, request_id: str, block_ids: Sequence[int], block_hashes: Sequence[bytes],
                           token_ids: TokenIds, parent_hash: bytes | None,
                           retention: pb.RetentionHint | None = None) -> CommitResult:
        """`commit`, then the request released, in one RPC (check `released`: see CommitResult);
        `retention`: a hint on the blocks, its token range counted from the request's first block."""
        return self._client._run(self._commit(request_id, block_ids, block_hashes, token_ids, parent_hash,
                                              release=True, retention=retention))

    def retain(self, block_hashes: Sequence[bytes], hint: pb.RetentionHint | None,
               action: pb.RetainRequest.Action = pb.RetainRequest.RETAIN,
               token_ids: TokenIds | None = None) -> pb.RetainResponse:
        """Retain on this session's pool: set (RETAIN), drop (RELEASE) or prefetch `hint` on the
        chain's leading cached blocks, block 0 first (hint's range: tokens of that chain)."""
        return self._client._run(self._retain(action, block_hashes, hint, token_ids))

    def release(self, request_id: str) -> int:
        return self._client._run(self._release(request_id))

    def fork(self, request_id: str, child_request_id: str) -> list[int]:
        return self._client._run(self._fork(request_id, child_request_id))

    def append_blocks(self, request_id: str, num_blocks: int) -> list[int]:
        return self._client._run(self._append_blocks(request_id, num_blocks))

    def prepare_write(self, request_id: str, position: int) -> tuple[int, bool]:
        return self._client._run(self._prepare_write(request_id, position))

    def close(self) -> None:
        """Stop the keepalive stream and unmap the pool. Idempotent."""
        if self.closed:
            return
        self.closed = True
        self._client._sessions.discard(self)
        if self._keepalive is not None:
            self._keepalive.close()
        if self.pool is not None:
            self.pool.close()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class KeepAlive:
    """A session's KeepAlive stream: the session id first, then a ping every lease_s / 3, sent by
    grpc's request thread; a daemon thread drains the responses and warns if the stream breaks.
    `close()` half-closes the stream (cancelling it if the daemon does not end it promptly)."""

    def __init__(self, client: KvtierClient, session: Session) -> None:
        self.session_id = session.session_id
        self.interval_s = session.keepalive_interval_s()
        self.target = client.target
        self._stop = threading.Event()
        self._call = client._stub.KeepAlive(self._requests(), metadata=client._metadata)
        self._thread = threading.Thread(target=self._drain, name=f"kvtierd-keepalive-{self.session_id}",
                                        daemon=True)
        self._thread.start()

    def _requests(self) -> Iterator[pb.KeepAliveRequest]:
        yield pb.KeepAliveRequest(session_id=self.session_id)
        while not self._stop.wait(self.interval_s):
            yield pb.KeepAliveRequest()

    def _drain(self) -> None:
        try:
            for _ in self._call:
                pass
        except grpc.RpcError as error:
            if not self._stop.is_set():
                log.warning("kvtierd keepalive of session %s at %s broke (%s: %s); the daemon will reclaim "
                            "the session and later calls get NOT_FOUND", self.session_id, self.target,
                            error.code().name, error.details())
            return
        if not self._stop.is_set():
            log.warning("kvtierd at %s ended the keepalive of session %s; the daemon will reclaim the session",
                        self.target, self.session_id)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(KEEPALIVE_CLOSE_GRACE_S)
        if self._thread.is_alive():
            self._call.cancel()
            self._thread.join(KEEPALIVE_CLOSE_GRACE_S)


class EventStream(EventStreamBase):
    """Events as an iterator. `cancel()` or closing the client ends it (StopIteration); an
    UNAVAILABLE is retried like a unary call, resuming after the last event delivered."""

    def __iter__(self) -> EventStream:
        return self

    def __next__(self) -> pb.Event:
        while True:
            try:
                event = next(self._call)
            except grpc.RpcError as error:
                if self._cancelled or self._client.closed:
                    raise StopIteration from None
                delay = self._retry.next_delay(error.code())
                if delay is None:
                    raise map_rpc_error(error, self._client.target) from error
                time.sleep(delay)
                self._call = self._open()
                continue
            return self._delivered(event)

    def cancel(self) -> None:
        self._cancelled = True
        self._call.cancel()
