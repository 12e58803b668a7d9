"""kvtierd's index events as vLLM's KV events: a msgpack `KVEventBatch` that vLLM's own decoder
(`msgspec.msgpack.Decoder(type=vllm.distributed.kv_events.KVEventBatch)`) reads, and so do the
routers that read vLLM (llm-d's kv-cache indexer, Dynamo's KV router).

The wire shape, as the installed vLLM (0.32.0) encodes it (vllm/distributed/kv_events.py):
- the batch is an array `[ts, events, data_parallel_rank]` (EventBatch is `array_like`);
- each event is a map tagged by `"type"` (KVCacheEvent is `tag=True`, not `array_like` since
  vLLM #42892), its fields in declaration order, the defaulted ones left out (`omit_defaults`):
  BlockStored {type, block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
  lora_name, extra_keys}; BlockRemoved {type, block_hashes, medium}; AllBlocksCleared {type}.
  `format = "array"` writes the older positional form, `["BlockStored", block_hashes, ...]`
  in the same order, for consumers of vLLM before #42892.

What kvtierd puts in them:
- block_hashes / parent_block_hash: the client's hashes (the daemon key less its tenant tag,
  daemon_key.py), i.e. the engine's own: through the vLLM connector they are vLLM's
  `Request.block_hashes`. As vLLM sends them by default (maybe_convert_block_hash with
  VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1): the last 8 bytes as a big-endian u64; with
  `int_block_hashes = false` the whole hash, as bytes (ExternalBlockHash is `bytes | int`). The
  parent of a chain's first block (the root from Attach) is None, as in vLLM.
- token_ids, block_size: the tokens each block was committed with, the pool's block size.
- medium: "GPU" for T0, "CPU" for T1, "STORAGE" for T2. T3 (the shared Redis tier) is not
  published: every node reaches it alike, so it cannot make a router prefer this node.
- extra_keys, one entry per block as vLLM has it: with `salt = "tenant"`, a chain's first block
  carries `(tenant name,)` — the untagged shape vLLM gives a cache_salt, on the first block only
  — and every other block None. A router that salts each request with its tenant's name then keeps
  tenants apart (their blocks have equal client hashes). `salt = "none"`: every entry None.
- lora_id, lora_name: None (a LoRA is inside the client's hash; the daemon never sees its name).

Consecutive stored blocks of one chain and tier become one BlockStored (as vLLM sends a request's
blocks), consecutive removals of one tier one BlockRemoved.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import cast

import msgspec
import numpy as np

from kvtierd.daemon_key import client_hash_of, tenant_tag_of
from kvtierd.index.index_events import AllBlocksCleared, BlockRemoved, BlockStored, IndexEvent

MEDIUM_GPU, MEDIUM_CPU, MEDIUM_STORAGE = "GPU", "CPU", "STORAGE"  # vLLM's MEDIUM_* names


@dataclasses.dataclass(frozen=True, slots=True)
class WireFormat:
    """How events are written (the [events] keys of the same names)."""

    format: str = "map"  # "map" | "array"
    int_block_hashes: bool = True
    salt: str = "tenant"  # "tenant" | "none"
    data_parallel_rank: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class PoolEvents:
    """What one pump took from one pool: (medium, events) per tier, oldest first."""

    model_id: str
    block_size: int
    client_root: bytes  # the parent of every chain's first block (Attach's root_hash)
    events_by_medium: tuple[tuple[str, Sequence[IndexEvent]], ...]

    @property
    def num_events(self) -> int:
        return sum(len(events) for _, events in self.events_by_medium)


class BatchEncoder:
    """PoolEvents → the bytes of one KVEventBatch. `tenant_name(tag)` names a tenant tag."""

    def __init__(self, wire: WireFormat, tenant_name: Callable[[bytes], str]) -> None:
        self.wire = wire
        self.tenant_name = tenant_name
        self._encoder = msgspec.msgpack.Encoder()

    def encode(self, pool: PoolEvents, ts: float) -> bytes:
        events = [event for medium, tier_events in pool.events_by_medium
                  for event in self._events(pool, medium, tier_events)]
        return self._encoder.encode([ts, events, self.wire.data_parallel_rank])

    def _events(self, pool: PoolEvents, medium: str, events: Sequence[IndexEvent]) -> list:
        out, run = [], []  # run: consecutive events of one kind, merged into one message
        for event in events:
            if run and not _continues(run, event):
                out.append(self._message(pool, medium, run))
                run = []
            run.append(event)
        if run:
            out.append(self._message(pool, medium, run))
        return out

    def _message(self, pool: PoolEvents, medium: str, run: list[IndexEvent]) -> list | dict:
        first = run[0]
        if isinstance(first, AllBlocksCleared):
            return self._shape("AllBlocksCleared", {})
        # A run is of one kind (_continues): removals, or stored blocks.
        hashes = [self._hash(client_hash_of(event.block_hash))
                  for event in cast("list[BlockRemoved] | list[BlockStored]", run)]
        if isinstance(first, BlockRemoved):
            return self._shape("BlockRemoved", {"block_hashes": hashes, "medium": medium})
        stored = cast("list[BlockStored]", run)
        parent = client_hash_of(first.parent_hash) if first.parent_hash is not None else None
        at_root = parent is None or parent == pool.client_root
        salt = (self.tenant_name(tenant_tag_of(first.block_hash)),) if self.wire.salt == "tenant" else None
        tokens = b"".join(event.token_ids or b"" for event in stored)
        return self._shape("BlockStored", {
            "block_hashes": hashes,
            "parent_block_hash": None if at_root or parent is None else self._hash(parent),
            "token_ids": np.frombuffer(tokens, dtype="<u4").tolist(),
            "block_size": pool.block_size,
            "lora_id": None,
            "medium": medium,
            "lora_name": None,
            "extra_keys": [salt if at_root and i == 0 else None for i in range(len(run))],
        })

    def _hash(self, client_hash: bytes) -> bytes | int:
        if self.wire.int_block_hashes:
            return int.from_bytes(client_hash[-8:], "big")
        return client_hash

    def _shape(self, tag: str, fields: dict) -> list | dict:
        if self.wire.format == "array":
            return [tag, *fields.values()]
        return {"type": tag, **fields}


def _continues(run: list[IndexEvent], event: IndexEvent) -> bool:
    """Whether `event` joins the run: removals with removals, a stored block with the stored block
    before it in its chain (one BlockStored is one parent-linked run, as in vLLM)."""
    last = run[-1]
    if isinstance(event, BlockRemoved):
        return isinstance(last, BlockRemoved)
    if isinstance(event, BlockStored):
        return isinstance(last, BlockStored) and event.parent_hash == last.block_hash
    return False
