"""The KvTier service: each RPC of proto/kvtierd/v1/kvtier.proto translated to the core.

Handlers raise kvtierd.errors; the interceptor (interceptor.py) maps them to status
codes and resolves the caller's tenant (`current_tenant()`). Every handler validates its whole
request before the first change, so a bad request changes nothing. Client hashes become the
daemon's keys by the tenant's prefix in request_terms.py, and only there.

Each handler decodes, authorizes, calls the tier manager (or the session table, or the node's
Put and Get: node/block_transfers.py), encodes. The loop waits on no copy and no disk: the core's
blocking steps (Put's writes, a copy-on-write, Get's serialization of block bytes) run on the
default executor, a call that may wait on the shared store runs there too (node/off_loop.py), and
a handler that hands out blocks still being written back (tiering/write_backs.py) answers once
their `writable` resolves.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar

from kvtierd import __version__
from kvtierd.daemon_key import DaemonKey
from kvtierd.errors import DRAINING_DETAILS, DeadlineExceeded, FailedPrecondition, InvalidArgument, Unavailable
from kvtierd.events.event_feed import EventFeed
from kvtierd.index.query_counting import QueryCounting
from kvtierd.layout import Layout
from kvtierd.node.block_transfers import BlockTransfers
from kvtierd.node.off_loop import call_blocking_if
from kvtierd.node.operations import EvictCounts, Operations
from kvtierd.node.pools import LayoutPool, PoolRegistry
from kvtierd.node.sessions import SessionLease, SessionTable
from kvtierd.retention.hint import RetentionHint
from kvtierd.server.fd_listener import FdListener
from kvtierd.server.interceptor import current_tenant
from kvtierd.server.pool_stats import pool_stats, remote_store_message
from kvtierd.server.request_terms import (
    acquire_parent,
    chains_of,
    check_hold_id,
    client_keys,
    packed_tokens,
    parent_key,
    position_of,
)
from kvtierd.server.retention_terms import UNBOUNDED_TOKENS, check_put_end, hint_of, retain, retain_committed
from kvtierd.server.stream_items import items_until
from kvtierd.t0.factory import shareable_fd
from kvtierd.t0.pool_handle import FD_KINDS
from kvtierd.tiering.block_io import PutBlock
from kvtierd.tiering.retention_hints import RetainOutcome
from kvtierd.tiering.tier_config import LAYOUT_COST
from kvtierd.token_bytes import pack_token_ids
from kvtierd.v1 import kvtier_pb2 as pb
from kvtierd.v1 import kvtier_pb2_grpc
from kvtierd.wire.block_frames import PutFrame, encode_get_response
from kvtierd.wire.conversions import acquired_to_proto_fields, handle_to_proto, layout_from_proto, lookup_to_proto

if TYPE_CHECKING:
    from grpc.aio import ServicerContext as Context

T = TypeVar("T")


class KvTierServicer(kvtier_pb2_grpc.KvTierServicer):
    def __init__(self, registry: PoolRegistry, sessions: SessionTable, feed: EventFeed,
                 default_wait_s: float = 60.0, operations: Operations | None = None,
                 on_drain: Callable[[bool], Awaitable[None]] | None = None) -> None:
        self.registry = registry
        self.sessions = sessions
        self.feed = feed
        self.operations = operations or Operations(registry, sessions, admin_tenants=())
        self._on_drain = on_drain  # the daemon's health status follows a drain
        self.default_wait_s = default_wait_s
        self.transfers = BlockTransfers(sessions.quotas)  # Put and Get
        self._shutdown = asyncio.Event()  # set at SIGTERM: long-lived streams end at once
        self.fd_listener: FdListener | None = None  # the fd socket's server (serve.py sets it)
        self.node_ssd = pb.SsdStats()  # the node's T2 as start-up found it (serve.py sets it; ssd_state.py)

    def begin_shutdown(self) -> None:
        """End every KeepAlive and Events stream now (sessions are then reclaimed), so that the
        server's grace period is spent on calls that finish, not on streams that never do."""
        self._shutdown.set()

    def _until_shutdown(self, next_item: Callable[[], Awaitable[T]]) -> AsyncIterator[T]:
        return items_until(next_item, self._shutdown)

    # ----------------------------------------------------------------------------- sessions

    async def Attach(self, request: pb.AttachRequest, context: Context) -> pb.AttachResponse:
        tenant = current_tenant()
        if self.operations.draining:
            raise Unavailable(f"{DRAINING_DETAILS} for maintenance and admits no new sessions "
                              "(`kvtierctl drain --resume` undoes it)")
        self.operations.remember(tenant)
        layout = layout_from_proto(request.layout)
        algo = request.hash_algo or "sha256"
        if algo != self.registry.settings.hash_algo:
            raise FailedPrecondition(f"this daemon keys blocks with {self.registry.settings.hash_algo}, "
                                     f"the client with {algo}")
        peer_uid = self._fd_peer_uid(request.fd_peer)
        pool = await self._pool(layout)
        session = self.sessions.open(tenant, pool)
        handle = handle_to_proto(pool.manager.device_pool.handle)
        if peer_uid is not None and handle.kind in FD_KINDS:
            assert self.fd_listener is not None, "the peer was found on it"
            handle.fd_ticket = self.fd_listener.issue(
                peer_uid, session.session_id, functools.partial(shareable_fd, pool.manager.device_pool),
                lambda: not session.closed)
        return pb.AttachResponse(
            session_id=session.session_id, pool=handle,
            bytes_per_block=layout.bytes_per_block, root_hash=pool.client_root, hash_size=pool.digest_size,
            lease_s=self.sessions.lease_s, tenant=tenant.name)

    def _fd_peer_uid(self, fd_peer: str) -> int | None:
        """The uid of the fd socket connection an Attach names (None: it names none)."""
        if not fd_peer:
            return None
        uid = self.fd_listener.peer_uid(fd_peer) if self.fd_listener is not None else None
        if uid is None:
            raise FailedPrecondition("fd_peer names no open connection to this daemon's fd socket "
                                     "(connect to <socket>.fds first and keep it open during Attach)")
        return uid

    async def KeepAlive(self, request_iterator: AsyncIterator[pb.KeepAliveRequest],
                        context: Context) -> AsyncIterator[pb.KeepAliveResponse]:
        tenant = current_tenant()
        session = None
        try:
            async for ping in self._until_shutdown(request_iterator.__aiter__().__anext__):
                if session is None:
                    session = self.sessions.get(ping.session_id, tenant)
                    self.sessions.stream_opened(session)
                else:
                    self.sessions.get(session.session_id, tenant)
                yield pb.KeepAliveResponse(lease_s=self.sessions.lease_s)
        finally:
            if session is not None:
                self.sessions.stream_closed(session)

    # ----------------------------------------------------------------------------- blocks

    async def Lookup(self, request: pb.LookupRequest, context: Context) -> pb.LookupResponse:
        session = self._session(request.session_id)
        check_hold_id(request.hold_id)
        keys = client_keys(session.tenant, session.pool, request.block_hashes)
        manager = session.pool.manager
        chains = chains_of(keys, packed_tokens(request.token_ids), list(request.chain_lengths),
                           session.pool.layout.block_size)
        if request.num_query_blocks > len(chains[0][0]):  # the query: the first chain's leading blocks
            raise InvalidArgument(f"num_query_blocks ({request.num_query_blocks}) exceeds the first chain's "
                                  f"{len(chains[0][0])} blocks")
        lookup = functools.partial(manager.lookup_chains, chains, prefetch=request.prefetch,
                                   num_query_blocks=request.num_query_blocks,
                                   hold=(session.tenant.tag, request.hold_id) if request.hold_id else None)
        answer = await call_blocking_if(manager.has_remote, lookup)  # with T3: a round trip, on a thread
        return lookup_to_proto(answer, per_chain=bool(request.chain_lengths))

    async def Acquire(self, request: pb.AcquireRequest, context: Context) -> pb.AcquireResponse:
        session = self._session(request.session_id)
        check_hold_id(request.hold_id)
        session.check_new(request.request_id)
        keys = client_keys(session.tenant, session.pool, request.block_hashes)
        first_parent = acquire_parent(session.pool, request.parent_hash)
        self.sessions.check_quota(session, len(keys) + request.num_extra_blocks)
        manager, request_key = session.pool.manager, session.key(request.request_id)
        counting = QueryCounting.NOTHING if request.for_store or request.query_counted else QueryCounting.QUERY_AND_HITS
        manager.report_recompute(request.recompute_s_per_token)  # before its hits are weighed (a bad value: no change)
        acquire = functools.partial(manager.acquire, request_key, keys, request.num_extra_blocks,
                                    packed_tokens(request.token_ids), counting=counting,
                                    recompute_s_per_token=None if request.load_every_hit else LAYOUT_COST)
        acquired = await call_blocking_if(manager.has_remote, acquire, lambda _: manager.release(request_key))
        if request.hold_id:  # the Lookup's hold: the request holds its blocks now
            manager.release_promise((session.tenant.tag, request.hold_id))
        pending = acquired.tier_blocks.num_lower_blocks > 0
        self.sessions.hold(session, request.request_id, len(acquired.block_ids), acquired.ticket if pending else None,
                           first_parent)
        if acquired.writable is not None:  # evicted bytes still being copied down: the client writes after
            await asyncio.wrap_future(acquired.writable)
        return pb.AcquireResponse(block_ids=acquired.block_ids, pending=pending,
                                  **acquired_to_proto_fields(acquired.tier_blocks))

    async def Wait(self, request: pb.WaitRequest, context: Context) -> pb.WaitResponse:
        if request.timeout_s < 0:
            raise InvalidArgument(f"timeout_s must be >= 0, got {request.timeout_s}")
        session = self._session(request.session_id)
        held = session.held(request.request_id)
        if held.ticket is None:
            return pb.WaitResponse(num_ready_blocks=session.pool.manager.num_committed_blocks(
                session.key(request.request_id)))
        timeout_s = request.timeout_s or self.default_wait_s
        try:
            ready = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(held.ticket.future)), timeout_s)
        except asyncio.TimeoutError:
            raise DeadlineExceeded(f"promotion of request {request.request_id!r} not finished after {timeout_s} s") \
                from None
        return pb.WaitResponse(num_ready_blocks=ready)

    async def Commit(self, request: pb.CommitRequest, context: Context) -> pb.CommitResponse:
        session = self._session(request.session_id)
        held = session.held(request.request_id)
        pool = session.pool
        keys = client_keys(session.tenant, pool, request.block_hashes)
        if len(request.block_ids) != len(keys) or not keys:
            raise InvalidArgument(f"commit needs one hash per block, got {len(request.block_ids)} block ids "
                                  f"and {len(keys)} hashes")
        key = session.key(request.request_id)
        position = position_of(pool, pool.manager.block_table(key), list(request.block_ids), request.request_id)
        parent = parent_key(session.tenant, pool, position, request.parent_hash, held.first_parent)
        num_chain_blocks = position + len(keys)  # the hint's range counts from the request's first token
        hint = hint_of(request.retention, pool, num_chain_blocks * pool.layout.block_size) \
            if request.HasField("retention") else None
        num_held = pool.manager.commit(key, position, keys, pack_token_ids(request.token_ids), parent)
        kept = retain_committed(pool, key, num_chain_blocks, hint) if hint is not None else RetainOutcome(0, 0)
        if request.release:
            await self.sessions.release(session, request.request_id)
        return pb.CommitResponse(num_committed_blocks=num_held, released=request.release,
                                 num_retained_blocks=kept.num_retained_blocks,
                                 num_downgraded_blocks=kept.num_downgraded_blocks)

    async def Release(self, request: pb.ReleaseRequest, context: Context) -> pb.ReleaseResponse:
        session = self._session(request.session_id)
        return pb.ReleaseResponse(num_released_blocks=await self.sessions.release(session, request.request_id))

    async def Fork(self, request: pb.ForkRequest, context: Context) -> pb.ForkResponse:
        session = self._session(request.session_id)
        held = session.held(request.request_id)
        session.check_new(request.child_request_id)
        if held.ticket is not None and not held.ticket.done():
            raise FailedPrecondition(f"request {request.request_id!r} has promotions in flight: Wait before Fork")
        self.sessions.check_quota(session, held.num_blocks)
        block_ids = session.pool.manager.fork(session.key(request.request_id), session.key(request.child_request_id))
        self.sessions.hold(session, request.child_request_id, len(block_ids), first_parent=held.first_parent)
        return pb.ForkResponse(block_ids=block_ids)

    async def AppendBlocks(self, request: pb.AppendBlocksRequest, context: Context) -> pb.AppendBlocksResponse:
        session = self._session(request.session_id)
        session.held(request.request_id)
        self.sessions.check_quota(session, request.num_blocks)
        block_ids, writable = session.pool.manager.append_blocks(session.key(request.request_id), request.num_blocks)
        self.sessions.grow(session, request.request_id, len(block_ids))
        if writable is not None:
            await asyncio.wrap_future(writable)
        return pb.AppendBlocksResponse(block_ids=block_ids)

    async def PrepareWrite(self, request: pb.PrepareWriteRequest, context: Context) -> pb.PrepareWriteResponse:
        session = self._session(request.session_id)
        session.held(request.request_id)
        # a copy-on-write into a block just evicted waits for its write-back: off the loop
        target = await asyncio.to_thread(session.pool.manager.prepare_write, session.key(request.request_id),
                                         request.position)
        return pb.PrepareWriteResponse(block_id=target.block_id, copied=target.copied_from is not None)

    # ----------------------------------------------------------------------------- bytes

    async def Put(self, request_iterator: AsyncIterator[bytes], context: Context) -> pb.PutResponse:
        tenant = current_tenant()
        self.operations.remember(tenant)
        frames = (PutFrame.decode(raw) async for raw in request_iterator)  # serialized: the bytes are not copied
        first = await anext(frames, None)
        if first is None:
            raise InvalidArgument("Put needs at least one block")
        if first.layout is None:
            raise InvalidArgument("the first message of a Put must name the layout")
        pool = await self._pool(layout_from_proto(first.layout))
        parent = parent_key(tenant, pool, 1, first.parent_hash) if first.parent_hash else tenant.key(pool.client_root)
        hint = hint_of(first.retention, pool, UNBOUNDED_TOKENS) if first.retention is not None else None
        chain: list[DaemonKey] = []  # the Put's keys, for its hint

        def block_of(frame: PutFrame) -> PutBlock:
            chain.append(client_keys(tenant, pool, [frame.block_hash])[0])
            return PutBlock(chain[-1], frame.token_ids, frame.data)

        async def blocks() -> AsyncIterator[PutBlock]:
            yield block_of(first)
            async for frame in frames:
                yield block_of(frame)

        checked: list[RetentionHint] = []  # the hint over the Put's blocks, checked before they are committed

        def check_hint_end(num_blocks: int) -> None:
            if hint is not None:
                checked.append(check_put_end(hint, num_blocks, pool.layout.block_size))

        put = await self.transfers.put(tenant, pool, parent, blocks(), check_hint_end)
        if checked:
            pool.manager.retention.retain(chain, checked[0])
        return pb.PutResponse(num_blocks=put.num_blocks, num_already_cached_blocks=put.num_already_cached)

    async def Get(self, request: pb.GetRequest, context: Context) -> AsyncIterator[bytes]:
        tenant = current_tenant()
        pool = await self._stored_pool(layout_from_proto(request.layout))
        if pool is None:
            return
        hashes = list(request.block_hashes)

        def encode(position: int, data: memoryview) -> bytes:  # a serialized GetResponse (block_frames.py)
            return encode_get_response(hashes[position], data)

        frames = self.transfers.get(tenant, pool, client_keys(tenant, pool, hashes), packed_tokens(request.token_ids),
                                    encode)
        async with contextlib.aclosing(frames):  # a stream closed early releases the blocks now, not at collection
            async for frame in frames:
                yield frame

    async def Retain(self, request: pb.RetainRequest, context: Context) -> pb.RetainResponse:
        tenant = current_tenant()
        pool = await self._stored_pool(layout_from_proto(request.layout))
        keys = client_keys(tenant, pool, request.block_hashes) if pool is not None else []
        return retain(tenant, pool, request, keys, packed_tokens(request.token_ids))

    # ----------------------------------------------------------------------------- observing

    async def Stats(self, request: pb.StatsRequest, context: Context) -> pb.StatsResponse:
        return pb.StatsResponse(pools=[pool_stats(pool) for pool in self.registry.pools()],
                                num_sessions=len(self.sessions), num_reclaimed_refs=self.sessions.num_reclaimed_refs,
                                version=__version__, remote=remote_store_message(self.registry.remote_store),
                                draining=self.operations.draining, ssd=self.node_ssd)

    # ----------------------------------------------------------------------------- operations

    async def TenantStats(self, request: pb.TenantStatsRequest, context: Context) -> pb.TenantStatsResponse:
        rows = await asyncio.to_thread(self.operations.tenant_usage, current_tenant(), request.tenant)
        return pb.TenantStatsResponse(usage=[pb.TenantUsage(**row) for row in rows])

    async def Evict(self, request: pb.EvictRequest, context: Context) -> pb.EvictResponse:
        pools = None
        if request.HasField("layout"):
            pool = self.registry.get(layout_from_proto(request.layout))
            pools = [] if pool is None else [pool]
        counts = await asyncio.to_thread(self.operations.evict, current_tenant(), request.tenant, request.all_tenants,
                                         list(request.tiers), pools)
        return evict_response(counts)

    async def Forget(self, request: pb.ForgetRequest, context: Context) -> pb.ForgetResponse:
        forgotten = await asyncio.to_thread(self.operations.forget, current_tenant(), request.tenant)
        return pb.ForgetResponse(key_destroyed=forgotten.key_destroyed, dropped=evict_response(forgotten.dropped),
                                 settled=forgotten.settled)

    async def Drain(self, request: pb.DrainRequest, context: Context) -> pb.DrainResponse:
        draining = self.operations.drain(current_tenant(), request.resume)
        if self._on_drain is not None:
            await self._on_drain(draining)
        return pb.DrainResponse(draining=draining, num_sessions=len(self.sessions))

    async def Events(self, request: pb.EventsRequest, context: Context) -> AsyncIterator[pb.Event]:
        layout = layout_from_proto(request.layout) if request.HasField("layout") else None
        resume = request.resume_after_seq if request.HasField("resume_after_seq") else None
        subscription = self.feed.subscribe(current_tenant(), layout, resume, request.feed_id)
        async for event in self._until_shutdown(subscription.next):
            yield event

    # ----------------------------------------------------------------------------- helpers

    def _session(self, session_id: str) -> SessionLease:
        return self.sessions.get(session_id, current_tenant())

    async def _stored_pool(self, layout: Layout) -> LayoutPool | None:
        """The layout's pool, opened from T2 when it is stored there; None when the daemon holds none."""
        return self.registry.get(layout) or await asyncio.to_thread(self.registry.get_stored, layout)

    async def _pool(self, layout: Layout) -> LayoutPool:
        pool = self.registry.get(layout)
        return pool if pool is not None else await asyncio.to_thread(self.registry.get_or_create, layout)


def evict_response(counts: EvictCounts) -> pb.EvictResponse:
    return pb.EvictResponse(num_t0_blocks=counts.t0, num_t1_blocks=counts.t1, num_t2_blocks=counts.t2,
                            num_t0_held_blocks=counts.t0_held)
