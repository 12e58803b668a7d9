"""kvtierd's index events as vLLM KV event batches, decoded with plain msgpack (not the encoder's
library): field order, merged runs, the root parent, the salt, hash forms, both formats.
tests/connectors/vllm/on_vllm/test_events_decode_with_vllm.py decodes them with vLLM's own classes."""

from __future__ import annotations

import msgpack
import pytest

from kvtierd.events.vllm_events import BatchEncoder, PoolEvents, WireFormat
from kvtierd.index.index_events import AllBlocksCleared, BlockRemoved, BlockStored
from kvtierd.node.tenants import Tenant
from kvtierd.token_bytes import pack_token_ids

ROOT = b"\xee" * 32
ACME, GLOBEX = Tenant.named("acme"), Tenant.named("globex")
NAMES = {ACME.tag: "acme", GLOBEX.tag: "globex"}


def chain(tenant: Tenant, n: int, start: int = 0) -> list[BlockStored]:
    """n chained stored blocks of `tenant` from the root, 2 tokens each."""
    events, parent = [], tenant.key(ROOT)
    for i in range(start, start + n):
        key = tenant.key(bytes([i]) * 32)
        events.append(BlockStored(key, parent, i, pack_token_ids([10 * i, 10 * i + 1])))
        parent = key
    return events


def u64(block_hash: bytes) -> int:
    """vLLM's int form of a hash (maybe_convert_block_hash): its last 8 bytes, big-endian."""
    return int.from_bytes(block_hash[-8:], "big")


def decode(events_by_medium, **wire) -> list:
    encoder = BatchEncoder(WireFormat(**wire), NAMES.__getitem__)
    payload = encoder.encode(PoolEvents("m", 2, ROOT, tuple(events_by_medium)), ts=12.5)
    ts, events, rank = msgpack.unpackb(payload)
    assert (ts, rank) == (12.5, 0)
    return events


def test_a_chain_becomes_one_block_stored_in_vllms_field_order_with_the_salt_on_its_first_block():
    [stored] = decode([("GPU", chain(ACME, 3))])
    assert list(stored) == ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                            "medium", "lora_name", "extra_keys"]
    assert stored == {"type": "BlockStored", "block_hashes": [u64(bytes([i]) * 32) for i in range(3)],
                      "parent_block_hash": None, "token_ids": [0, 1, 10, 11, 20, 21], "block_size": 2,
                      "lora_id": None, "medium": "GPU", "lora_name": None, "extra_keys": [["acme"], None, None]}


def test_runs_break_at_a_new_chain_a_new_kind_and_a_new_medium():
    """A continuation's parent is the previous block, unsalted; another tenant is its own run."""
    acme = chain(ACME, 4)
    events = decode([("GPU", [*acme[:2], *chain(GLOBEX, 1), acme[2], BlockRemoved(acme[0].block_hash),
                              BlockRemoved(acme[1].block_hash), AllBlocksCleared()]),
                     ("CPU", [acme[3]]), ("STORAGE", [BlockRemoved(acme[3].block_hash)])])
    assert [(e["type"], e.get("medium"), len(e.get("block_hashes", []))) for e in events] == [
        ("BlockStored", "GPU", 2), ("BlockStored", "GPU", 1), ("BlockStored", "GPU", 1), ("BlockRemoved", "GPU", 2),
        ("AllBlocksCleared", None, 0), ("BlockStored", "CPU", 1), ("BlockRemoved", "STORAGE", 1)]
    assert events[1]["extra_keys"] == [["globex"]]
    assert events[2]["parent_block_hash"] == u64(bytes([1]) * 32) and events[2]["extra_keys"] == [None]
    assert events[3] == {"type": "BlockRemoved", "block_hashes": [0, u64(bytes([1]) * 32)], "medium": "GPU"}
    assert events[4] == {"type": "AllBlocksCleared"}


def test_salt_none_byte_hashes_and_the_positional_format():
    events = decode([("GPU", chain(ACME, 2)), ("CPU", [BlockRemoved(ACME.key(bytes([1]) * 32))])],
                    format="array", int_block_hashes=False, salt="none")
    first, second = bytes([0]) * 32, bytes([1]) * 32  # whole client hashes, as bytes
    assert events == [["BlockStored", [first, second], None, [0, 1, 10, 11], 2, None, "GPU", None, [None, None]],
                      ["BlockRemoved", [second], "CPU"]]


@pytest.mark.parametrize("salt", ["tenant", "none"])
def test_a_salted_chain_and_an_unsalted_one_differ_only_in_extra_keys(salt):
    acme, globex = decode([("GPU", chain(ACME, 2))], salt=salt), decode([("GPU", chain(GLOBEX, 2))], salt=salt)
    assert acme[0]["block_hashes"] == globex[0]["block_hashes"]  # equal client hashes: the salt tells them apart
    assert (acme[0]["extra_keys"] != globex[0]["extra_keys"]) == (salt == "tenant")
