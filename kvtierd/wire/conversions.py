"""Conversions between the core's types and the messages of kvtierd.v1, shared by the server
and the client library. Every field read from the wire is validated here: a malformed layout or
pool handle is an InvalidArgument, never a half-built object."""

from __future__ import annotations

from collections.abc import Iterable

from kvtierd.chain_lookup import ChainLookup, declined_tail
from kvtierd.errors import FailedPrecondition, InvalidArgument
from kvtierd.layout import Layout
from kvtierd.t0.pool_handle import PoolHandle
from kvtierd.tier import TierCounts
from kvtierd.v1 import kvtier_pb2 as pb


def layout_to_proto(layout: Layout) -> pb.Layout:
    return pb.Layout(model_id=layout.model_id, num_layers=layout.num_layers, num_kv_heads=layout.num_kv_heads,
                     head_dim=layout.head_dim, block_size=layout.block_size, dtype=layout.dtype,
                     tp_rank=layout.tp_rank, tp_size=layout.tp_size)


def layout_from_proto(message: pb.Layout) -> Layout:
    """The Layout a message names; InvalidArgument when a field is missing or out of range.
    An empty dtype reads as float16 and a tp_size of 0 as 1 (proto3 defaults)."""
    return Layout(message.model_id, message.num_layers, message.num_kv_heads, message.head_dim,
                  message.block_size, message.dtype or "float16", message.tp_rank, message.tp_size or 1)


def handle_to_proto(handle: PoolHandle) -> pb.PoolHandle:
    return pb.PoolHandle(kind=handle.kind, shm_name=handle.name or "", cuda_ipc_handle=handle.ipc_handle or b"",
                         device_index=handle.device_index or 0, num_blocks=handle.num_blocks, nbytes=handle.nbytes)


def handle_from_proto(message: pb.PoolHandle, layout: Layout) -> PoolHandle:
    if message.kind == "shm":
        return PoolHandle("shm", layout, message.num_blocks, message.nbytes, name=message.shm_name)
    if message.kind == "cuda_fd":
        return PoolHandle("cuda_fd", layout, message.num_blocks, message.nbytes, device_index=message.device_index)
    if message.kind == "cuda_ipc":
        return PoolHandle("cuda_ipc", layout, message.num_blocks, message.nbytes,
                          ipc_handle=message.cuda_ipc_handle, device_index=message.device_index)
    raise InvalidArgument(f"unknown pool handle kind {message.kind!r}")


def hits_to_proto_fields(hits: TierCounts) -> dict[str, int]:
    """The fields of a LookupResponse or ChainHits: the leading blocks found in each tier, and all."""
    return dict(num_hit_blocks=hits.num_blocks, num_t0_blocks=hits.t0, num_t1_blocks=hits.t1,
                num_t2_blocks=hits.t2, num_t3_blocks=hits.t3)


def hits_from_proto(message: pb.LookupResponse | pb.ChainHits) -> TierCounts:
    """The leading blocks a Lookup (or one of its chains) found in each tier."""
    return TierCounts(message.num_t0_blocks, message.num_t1_blocks, message.num_t2_blocks, message.num_t3_blocks)


def lookup_to_proto(answer: ChainLookup, per_chain: bool) -> pb.LookupResponse:
    """A LookupResponse: every chain's hits added up, and each chain's (`per_chain`: the request
    named chain_lengths)."""
    chains = [pb.ChainHits(**hits_to_proto_fields(h), num_declined_blocks=d.num_blocks)
              for h, d in zip(answer.hits, answer.declined)] if per_chain else []
    return pb.LookupResponse(**hits_to_proto_fields(answer.total), chains=chains,
                             num_declined_blocks=answer.num_declined_blocks)


def lookup_from_proto(message: pb.LookupResponse, num_chains: int) -> ChainLookup:
    """A Lookup's answer for the `num_chains` chains it asked (0: one chain, no chain_lengths).
    A daemon that predates chain_lengths answers one chain at the top level. An answer of another
    number of chains than asked, or declining more blocks than a chain's hits, is a
    FailedPrecondition (no part of it is used)."""
    parts = list(message.chains) if num_chains else [message]
    if num_chains == 1 and not parts:
        parts = [message]
    if len(parts) != max(num_chains, 1):
        raise FailedPrecondition(f"the daemon answered {len(parts)} of the {num_chains} chains asked "
                                 "(older than this client?)")
    hits = [hits_from_proto(part) for part in parts]
    if any(part.num_declined_blocks > h.num_blocks for h, part in zip(hits, parts)):
        raise FailedPrecondition("the daemon declined more blocks of a chain than it found")
    return ChainLookup(tuple(hits), tuple(declined_tail(h, part.num_declined_blocks) for h, part in zip(hits, parts)))


def acquired_to_proto_fields(acquired: TierCounts) -> dict[str, int]:
    """The fields of an AcquireResponse: the hits in T0, then the blocks loading from each lower tier."""
    return dict(num_t0_hit_blocks=acquired.t0, num_t1_blocks=acquired.t1, num_t2_blocks=acquired.t2,
                num_t3_blocks=acquired.t3)


def acquired_from_proto(message: pb.AcquireResponse) -> TierCounts:
    """An Acquire's hits in T0, then the blocks being loaded from each lower tier."""
    return TierCounts(message.num_t0_hit_blocks, message.num_t1_blocks, message.num_t2_blocks, message.num_t3_blocks)


# Socket reads of up to 4 MiB instead of gRPC's 8 KiB default, so a 2 MiB block arrives in a few
# reads. Measured on the development machine, raw grpc.aio streaming of 2 MiB messages over a
# unix socket: 709 MB/s with the defaults, 1,054 MB/s with these (same run, same machine).
READ_CHUNK_OPTIONS = [
    ("grpc.experimental.tcp_read_chunk_size", 1 << 20),
    ("grpc.experimental.tcp_min_read_chunk_size", 256 << 10),
    ("grpc.experimental.tcp_max_read_chunk_size", 4 << 20),
]


def pool_layout(pools: Iterable[pb.PoolStats], model_id: str) -> Layout:
    """The layout of the one pool (of Stats' `pools`) for `model_id`; InvalidArgument naming the
    pools when there is none or more than one."""
    matches = [pool.layout for pool in pools if pool.layout.model_id == model_id]
    if len(matches) != 1:
        known = ", ".join(sorted({pool.layout.model_id for pool in pools})) or "none"
        raise InvalidArgument(f"{'no' if not matches else 'more than one'} pool of model id {model_id!r} "
                              f"(pools: {known})")
    return layout_from_proto(matches[0])
