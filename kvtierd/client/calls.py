"""The calls of kvtierd's RPCs as the sync and asyncio clients make them: each RPC's request and how
to read its response (`Call`), the Attach and operator calls, and those of an attached session
(`SessionBase`). No grpc here: base.py has the channel, the retries and the errors they run under.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from kvtierd.block_hash import Namespace
from kvtierd.client.block_data import TokenIds, hash_list, optional_tokens
from kvtierd.client.fd_channel import FdChannel
from kvtierd.errors import FailedPrecondition
from kvtierd.layout import Layout
from kvtierd.tier import AcquiredTierFields, TierCounts
from kvtierd.v1 import kvtier_pb2 as pb
from kvtierd.wire.conversions import acquired_from_proto, handle_from_proto, layout_to_proto, lookup_from_proto

if TYPE_CHECKING:
    from kvtierd.t0.device_pool import DevicePool

WAIT_MARGIN_S = 1.0  # Wait's RPC deadline is the daemon-side timeout plus this
ATTACH_TIMEOUT_S = 60.0  # the least deadline of an Attach (see attach_call)
OPERATION_TIMEOUT_S = 120.0  # Evict may copy a pool's worth of blocks down before it answers


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


def retain_call(layout: Layout, action: pb.RetainRequest.Action, block_hashes: Sequence[bytes],
                hint: pb.RetentionHint | None, token_ids: TokenIds | None) -> Call:
    """Retain on `layout`'s pool: RETAIN, RELEASE or PREFETCH (kvtier.proto's RetainRequest)."""
    return Call("Retain", pb.RetainRequest(action=action, layout=layout_to_proto(layout),
                                           block_hashes=hash_list(block_hashes),
                                           token_ids=optional_tokens(token_ids), hint=hint))


def tenant_stats_call(tenant: str) -> Call:
    return Call("TenantStats", pb.TenantStatsRequest(tenant=tenant), lambda r: list(r.usage))


def evict_call(tenant: str, all_tenants: bool, tiers: Sequence[str], layout: Layout | None) -> Call:
    request = pb.EvictRequest(tenant=tenant, all_tenants=all_tenants, tiers=list(tiers))
    if layout is not None:
        request.layout.CopyFrom(layout_to_proto(layout))
    return Call("Evict", request, timeout_s=OPERATION_TIMEOUT_S)


def forget_call(tenant: str) -> Call:
    return Call("Forget", pb.ForgetRequest(tenant=tenant), timeout_s=OPERATION_TIMEOUT_S)


def drain_call(resume: bool) -> Call:
    return Call("Drain", pb.DrainRequest(resume=resume))


@dataclasses.dataclass(frozen=True, slots=True)
class AcquireResult(AcquiredTierFields):
    """A request's block table from Acquire: hits first (loads pending if `pending`), then fresh."""

    block_ids: list[int]
    # the hits in T0, then the blocks being loaded from each lower tier, in the table's order
    # (T3's: Wait says how many landed)
    tier_blocks: TierCounts
    pending: bool

    @property
    def num_loading_blocks(self) -> int:
        """Blocks after the T0 hits being loaded from the lower tiers."""
        return self.tier_blocks.num_lower_blocks


@dataclasses.dataclass(frozen=True, slots=True)
class CommitResult:
    """A Commit that asked to release its request too: `released` is False from a daemon that
    predates the ask, which leaves the request held (release it with Release). With a retention
    hint: the blocks it covers now and those kept without it (the tenant's retention quota)."""

    num_committed_blocks: int
    released: bool
    num_retained_blocks: int = 0
    num_downgraded_blocks: int = 0


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

    def _lookup(self, block_hashes: Sequence[bytes], token_ids: TokenIds | None, prefetch: bool,
                chain_lengths: Sequence[int] | None, num_query_blocks: int, hold_id: str = "") -> Call:
        lengths = list(chain_lengths or ())
        return Call("Lookup", pb.LookupRequest(session_id=self.session_id, block_hashes=hash_list(block_hashes),
                                               token_ids=optional_tokens(token_ids), prefetch=prefetch,
                                               chain_lengths=lengths, num_query_blocks=num_query_blocks,
                                               hold_id=hold_id),
                    lambda r: lookup_from_proto(r, len(lengths)))

    def _acquire(self, request_id: str, block_hashes: Sequence[bytes], num_extra_blocks: int,
                 token_ids: TokenIds | None, for_store: bool,
                 query_counted: bool = False, parent_hash: bytes | None = None,
                 recompute_s_per_token: float = 0.0, load_every_hit: bool = False, hold_id: str = "") -> Call:
        request = pb.AcquireRequest(session_id=self.session_id, request_id=request_id, hold_id=hold_id,
                                    block_hashes=hash_list(block_hashes), token_ids=optional_tokens(token_ids),
                                    num_extra_blocks=num_extra_blocks, for_store=for_store,
                                    query_counted=query_counted, parent_hash=bytes(parent_hash or b""),
                                    recompute_s_per_token=recompute_s_per_token, load_every_hit=load_every_hit)
        return Call("Acquire", request,
                    lambda r: AcquireResult(list(r.block_ids), acquired_from_proto(r), r.pending))

    def _wait(self, request_id: str, timeout_s: float | None, default_timeout_s: float) -> Call:
        """The daemon waits `timeout_s` (None: the client's timeout); the RPC deadline adds a margin."""
        wait_s = default_timeout_s if timeout_s is None else timeout_s
        request = pb.WaitRequest(session_id=self.session_id, request_id=request_id, timeout_s=wait_s)
        return Call("Wait", request, lambda r: r.num_ready_blocks, timeout_s=wait_s + WAIT_MARGIN_S)

    def _commit(self, request_id: str, block_ids: Sequence[int], block_hashes: Sequence[bytes], token_ids: TokenIds,
                parent_hash: bytes | None, release: bool = False, retention: pb.RetentionHint | None = None) -> Call:
        """Commit (parsed: the blocks committed), or with `release` commit and release (parsed: a
        CommitResult); `retention`: a hint on the blocks (its range from the request's first token)."""
        request = pb.CommitRequest(session_id=self.session_id, request_id=request_id, block_ids=list(block_ids),
                                   block_hashes=hash_list(block_hashes), token_ids=optional_tokens(token_ids),
                                   parent_hash=bytes(self.root_hash if parent_hash is None else parent_hash),
                                   release=release, retention=retention)
        if release:
            return Call("Commit", request, lambda r: CommitResult(r.num_committed_blocks, r.released,
                                                                  r.num_retained_blocks, r.num_downgraded_blocks))
        return Call("Commit", request, lambda r: r.num_committed_blocks)

    def _retain(self, action: pb.RetainRequest.Action, block_hashes: Sequence[bytes],
                hint: pb.RetentionHint | None, token_ids: TokenIds | None) -> Call:
        """Retain on this session's pool (the call itself needs no session: the layout names the pool)."""
        return retain_call(self.layout, action, block_hashes, hint, token_ids)

    def _release(self, request_id: str) -> Call:
        return Call("Release", pb.ReleaseRequest(session_id=self.session_id, request_id=request_id),
                    lambda r: r.num_released_blocks)

    def _fork(self, request_id: str, child_request_id: str) -> Call:
        request = pb.ForkRequest(session_id=self.session_id, request_id=request_id,
                                 child_request_id=child_request_id)
        return Call("Fork", request, lambda r: list(r.block_ids))

    def _append_blocks(self, request_id: str, num_blocks: int) -> Call:
        request = pb.AppendBlocksRequest(session_id=self.session_id, request_id=request_id, num_blocks=num_blocks)
        return Call("AppendBlocks", request, lambda r: list(r.block_ids))

    def _prepare_write(self, request_id: str, position: int) -> Call:
        request = pb.PrepareWriteRequest(session_id=self.session_id, request_id=request_id, position=position)
        return Call("PrepareWrite", request, lambda r: (r.block_id, r.copied))

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"lease_s={self.lease_s}"
        return f"{type(self).__name__}({self.session_id!r}, tenant={self.tenant!r}, {self.layout.model_id!r}, {state})"
