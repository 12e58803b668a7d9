"""The asyncio client of kvtierd: `AsyncKvtierClient` and `AsyncSession`, the surface of
KvtierClient and Session (sync_client.py) as coroutines on a grpc.aio channel. Events is an async
iterator; a session's keepalive is an asyncio task. Retries, deadlines and error mapping
(base.py) and request building (calls.py) are shared with the blocking client.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from typing import TypeVar

import grpc
import grpc.aio

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
from kvtierd.layout import Layout
from kvtierd.v1 import kvtier_pb2 as pb

log = logging.getLogger(__name__)
T = TypeVar("T")
KEEPALIVE_CLOSE_GRACE_S = 0.5


class AsyncKvtierClient(ClientBase):
    """A grpc.aio channel to one daemon. Create and use it inside one event loop."""

    def __init__(self, target: str | None = None, *, token: str | None = None, tls: TlsOptions | None = None,
                 timeout_s: float = 5.0, max_attempts: int = 4, max_message_bytes: int = 16 << 20) -> None:
        super().__init__(grpc.aio, target, token, tls, timeout_s, max_attempts, max_message_bytes)

    async def _retrying(self, attempt: Callable[[float], Awaitable[T]], timeout_s: float | None) -> T:
        """Await `attempt(seconds_left)`, retrying UNAVAILABLE per the policy of base.Retry."""
        self._check_open()
        retry = Retry(self.max_attempts, self.timeout_s if timeout_s is None else timeout_s)
        while True:
            try:
                return await attempt(retry.remaining_s())
            except grpc.RpcError as error:
                delay = retry.next_delay(error.code())
                if delay is None:
                    raise map_rpc_error(error, self.target) from error
            await asyncio.sleep(delay)

    async def _run(self, call: Call):
        method = getattr(self._stub, call.method)
        return call.parse(await self._retrying(
            lambda timeout: method(call.request, timeout=timeout, metadata=self._metadata), call.timeout_s))

    async def attach(self, layout: Layout, *, map_pool: bool = True, hash_algo: str = "sha256",
                     keepalive: bool = True, deadline_s: float | None = None) -> AsyncSession:
        fd_channel = await asyncio.to_thread(self._fd_channel) if map_pool else None
        try:
            response = await self._run(attach_call(layout, hash_algo, self.timeout_s, deadline_s,
                                                   fd_channel.peer_token if fd_channel else ""))
            session = AsyncSession(self, layout, response, hash_algo)
            try:
                if map_pool:
                    await asyncio.to_thread(session.map_pool, fd_channel)
                if keepalive:
                    session._keepalive = AsyncKeepAlive(self, session)
            except BaseException:
                await session.close()
                raise
        finally:
            if fd_channel is not None:
                fd_channel.close()
        self._sessions.add(session)
        return session

    async def put(self, layout: Layout, blocks: Iterable[tuple[bytes, TokenIds, BlockData]],
                  parent_hash: bytes | None = None, *, timeout_s: float | None = None) -> PutResult:
        self._check_open()
        stream = PutStream(layout, blocks, parent_hash)
        try:
            response = await self._put(stream.requests(), metadata=self._metadata,
                                            timeout=self.timeout_s if timeout_s is None else timeout_s)
        except (grpc.RpcError, asyncio.CancelledError) as error:
            if stream.error is not None:  # grpc.aio cancels the call when the request iterator raises
                raise stream.error from None
            if isinstance(error, asyncio.CancelledError):
                raise
            raise map_rpc_error(error, self.target) from error
        return stream.result(response)

    async def get(self, layout: Layout, block_hashes: Sequence[bytes], token_ids: TokenIds | None = None, *,
                  timeout_s: float | None = None) -> list[tuple[bytes, bytes]]:
        request = get_request(layout, block_hashes, token_ids)

        async def attempt(timeout: float) -> list[tuple[bytes, bytes]]:
            blocks: list[tuple[bytes, bytes]] = []
            try:
                async for block in self._get(request, timeout=timeout, metadata=self._metadata):
                    blocks.append(block)  # (hash, data), decoded by block_frames.decode_get_response
            except grpc.RpcError as error:
                if blocks:  # data has flowed: no retry
                    raise map_rpc_error(error, self.target) from error
                raise
            return blocks

        return await self._retrying(attempt, timeout_s)

    async def stats(self) -> pb.StatsResponse:
        return await self._run(Call("Stats", pb.StatsRequest()))

    async def retain(self, layout: Layout, block_hashes: Sequence[bytes], hint: pb.RetentionHint | None = None, *,
                     action: pb.RetainRequest.Action = pb.RetainRequest.RETAIN,
                     token_ids: TokenIds | None = None) -> pb.RetainResponse:
        """Keep the caller's cached blocks of a chain through a pause (RETAIN `hint`), stop keeping them
        (RELEASE `hint.retention_session`'s hints; no hashes: on every block), or bring them up towards
        T0 (PREFETCH, and RETAIN when `hint` is given). No session: `layout` names the pool."""
        return await self._run(retain_call(layout, action, block_hashes, hint, token_ids))

    async def tenant_stats(self, tenant: str = "") -> list[pb.TenantUsage]:
        """Usage per pool of the caller ("") or a tenant; "*" = every tenant (admin)."""
        return await self._run(tenant_stats_call(tenant))

    async def evict(self, tenant: str = "", *, all_tenants: bool = False, tiers: Sequence[str] = (),
                    layout: Layout | None = None) -> pb.EvictResponse:
        """Drop unheld cached blocks from `tiers` (none: all three, a flush); see the Evict rpc."""
        return await self._run(evict_call(tenant, all_tenants, tiers, layout))

    async def forget(self, tenant: str) -> pb.ForgetResponse:
        """Admin: destroy the tenant's data key and drop its unheld blocks from every tier; see the Forget rpc."""
        return await self._run(forget_call(tenant))

    async def drain(self, resume: bool = False) -> pb.DrainResponse:
        return await self._run(drain_call(resume))

    def events(self, layout: Layout | None = None, *, timeout_s: float | None = None,
               resume_after_seq: int | None = None, feed_id: int = 0) -> AsyncEventStream:
        """An async iterator of events until `.cancel()`, `close()` or `timeout_s` (None: no end);
        resuming as KvtierClient.events does."""
        self._check_open()
        return AsyncEventStream(self, events_request(layout, resume_after_seq, feed_id), timeout_s)

    async def close(self) -> None:
        for session in list(self._sessions):
            await session.close()
        self.closed = True
        await self._channel.close()

    async def __aenter__(self) -> AsyncKvtierClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


class AsyncSession(SessionBase):
    """Session (client.py) as coroutines."""

    def __init__(self, client: AsyncKvtierClient, layout: Layout, response: pb.AttachResponse,
                 hash_algo: str) -> None:
        super().__init__(layout, response, hash_algo)
        self._client = client
        self._keepalive: AsyncKeepAlive | None = None

    async def lookup(self, block_hashes: Sequence[bytes], token_ids: TokenIds | None = None,
                     prefetch: bool = False, chain_lengths: Sequence[int] | None = None,
                     num_query_blocks: int = 0, hold_id: str = "") -> ChainLookup:
        """As Session.lookup."""
        return await self._client._run(self._lookup(block_hashes, token_ids, prefetch, chain_lengths,
                                                    num_query_blocks, hold_id))

    async def acquire(self, request_id: str, block_hashes: Sequence[bytes], num_extra_blocks: int = 0,
                      token_ids: TokenIds | None = None, for_store: bool = False, query_counted: bool = False,
                      parent_hash: bytes | None = None, recompute_s_per_token: float = 0.0,
                      load_every_hit: bool = False, hold_id: str = "") -> AcquireResult:
        """As Session.acquire."""
        return await self._client._run(self._acquire(request_id, block_hashes, num_extra_blocks, token_ids,
                                                     for_store, query_counted, parent_hash, recompute_s_per_token,
                                                     load_every_hit, hold_id))

    async def wait(self, request_id: str, timeout_s: float | None = None) -> int:
        return await self._client._run(self._wait(request_id, timeout_s, self._client.timeout_s))

    async def commit(self, request_id: str, block_ids: Sequence[int], block_hashes: Sequence[bytes],
                     token_ids: TokenIds, parent_hash: bytes | None) -> int:
        return await self._client._run(self._commit(request_id, block_ids, block_hashes, token_ids, parent_hash))

    async def commit_and_release(self, request_id: str, block_ids: Sequence[int], block_hashes: Sequence[bytes],
                                 token_ids: TokenIds, parent_hash: bytes | None) -> CommitResult:
        """As Session.commit_and_release."""
        return await self._client._run(self._commit(request_id, block_ids, block_hashes, token_ids, parent_hash,
                                                    release=True))

    async def release(self, request_id: str) -> int:
        return await self._client._run(self._release(request_id))

    async def fork(self, request_id: str, child_request_id: str) -> list[int]:
        return await self._client._run(self._fork(request_id, child_request_id))

    async def append_blocks(self, request_id: str, num_blocks: int) -> list[int]:
        return await self._client._run(self._append_blocks(request_id, num_blocks))

    async def prepare_write(self, request_id: str, position: int) -> tuple[int, bool]:
        return await self._client._run(self._prepare_write(request_id, position))

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._client._sessions.discard(self)
        if self._keepalive is not None:
            await self._keepalive.close()
        if self.pool is not None:
            self.pool.close()

    async def __aenter__(self) -> AsyncSession:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


class AsyncKeepAlive:
    """KeepAlive (client.py) as a task: session id first, a ping every lease_s / 3."""

    def __init__(self, client: AsyncKvtierClient, session: AsyncSession) -> None:
        self.session_id = session.session_id
        self.interval_s = session.keepalive_interval_s()
        self.target = client.target
        self._stop = asyncio.Event()
        self._call = client._stub.KeepAlive(self._requests(), metadata=client._metadata)
        self._task = asyncio.get_running_loop().create_task(self._drain())

    async def _requests(self) -> AsyncIterator[pb.KeepAliveRequest]:
        yield pb.KeepAliveRequest(session_id=self.session_id)
        while True:
            try:
                await asyncio.wait_for(self._stop.wait(), self.interval_s)
                return
            except asyncio.TimeoutError:
                yield pb.KeepAliveRequest()

    async def _drain(self) -> None:
        try:
            async for _ in self._call:
                pass
        except (grpc.RpcError, asyncio.CancelledError) as error:
            if not self._stop.is_set():
                what = f"{error.code().name}: {error.details()}" if isinstance(error, grpc.RpcError) else "cancelled"
                log.warning("kvtierd keepalive of session %s at %s broke (%s); the daemon will reclaim the "
                            "session and later calls get NOT_FOUND", self.session_id, self.target, what)
            return
        if not self._stop.is_set():
            log.warning("kvtierd at %s ended the keepalive of session %s; the daemon will reclaim the session",
                        self.target, self.session_id)

    async def close(self) -> None:
        self._stop.set()
        try:
            await asyncio.wait_for(asyncio.shield(self._task), KEEPALIVE_CLOSE_GRACE_S)
        except asyncio.TimeoutError:
            self._call.cancel()
            await asyncio.wait({self._task}, timeout=KEEPALIVE_CLOSE_GRACE_S)


class AsyncEventStream(EventStreamBase):
    """EventStream (client.py) as an async iterator."""

    def __aiter__(self) -> AsyncEventStream:
        return self

    async def __anext__(self) -> pb.Event:
        while True:
            try:
                event = await self._call.read()
            except (grpc.RpcError, asyncio.CancelledError) as error:
                if self._cancelled or self._client.closed:
                    raise StopAsyncIteration from None
                if isinstance(error, asyncio.CancelledError):
                    raise
                delay = self._retry.next_delay(error.code())
                if delay is None:
                    raise map_rpc_error(error, self._client.target) from error
                await asyncio.sleep(delay)
                self._call = self._open()
                continue
            # EOF comes from grpc's compiled cygrpc module, which has no stubs
            if event is grpc.aio.EOF:  # pyright: ignore[reportAttributeAccessIssue]
                raise StopAsyncIteration
            return self._delivered(event)

    def cancel(self) -> None:
        self._cancelled = True
        self._call.cancel()
