"""kvtierd's KV event feed read with the installed vLLM's own classes: the bytes a real `kvtierd
serve` published after Acquire/Commit/Release through KvtierClient decode with
`msgspec.msgpack.Decoder(type=vllm.distributed.kv_events.KVEventBatch)`, re-encode with vLLM's
encoder to the same bytes, and say what vLLM's own KVCacheManager says of the same request (its
block hashes, tokens, cache salt) — the salt being the tenant's name.

Runs in the vLLM venv (tests/connectors/vllm/test_on_installed_vllm.py runs this folder there).
"""

from __future__ import annotations

import time

import msgspec
import pytest
import torch
import zmq
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash, maybe_convert_block_hash
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request

from kvtierd.client import KvtierClient
from kvtierd.events.vllm_events import BatchEncoder, PoolEvents, WireFormat
from kvtierd.index.index_events import AllBlocksCleared as Cleared
from kvtierd.index.index_events import BlockRemoved as Removed
from kvtierd.index.index_events import BlockStored as Stored
from kvtierd.launch.daemon_process import DaemonProcess, small_daemon_args
from kvtierd.layout import Layout
from kvtierd.node.tenants import Tenant
from kvtierd.token_bytes import pack_token_ids

BLOCK_SIZE = 16
LAYOUT = Layout("events-model", 2, 2, 16, BLOCK_SIZE)
DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)
TENANT = "acme"


def vllm_request(request_id: str, token_ids: list[int], cache_salt: str | None) -> Request:
    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    return Request(request_id, token_ids, SamplingParams(max_tokens=4), None, cache_salt=cache_salt,
                   block_hasher=get_request_block_hasher(BLOCK_SIZE, hash_fn))


def vllm_own_events(request: Request) -> list:
    """What vLLM's KVCacheManager, with KV events on, publishes when it caches the request's prompt."""
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=8, dtype=torch.float16)
    config = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)])
    manager = KVCacheManager(config, max_model_len=4096, scheduler_block_size=BLOCK_SIZE, hash_block_size=BLOCK_SIZE,
                             enable_caching=True, enable_kv_cache_events=True)
    hit_blocks, num_hit_tokens = manager.get_computed_blocks(request)[:2]
    assert manager.allocate_slots(request, request.num_tokens - num_hit_tokens, num_hit_tokens, hit_blocks)
    return manager.take_events()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    directory = tmp_path_factory.mktemp("kvtierd-events")
    tokens_file = directory / "tokens"
    tokens_file.write_text(f"{TENANT} a-token\n")
    extra = ["--tokens-file", str(tokens_file), "--set", "events.zmq_endpoint=tcp://127.0.0.1:0",
             "--set", "policy.t0_to_t1=write_through", "--set", "policy.t1_to_t2=write_through"]
    with DaemonProcess(small_daemon_args(str(directory), t0_bytes="8MiB", extra=extra)) as process:
        yield process


def commit(client: KvtierClient, request_id: str, token_ids: list[int], hashes: list[bytes]) -> None:
    """What the connector does: vLLM's own block hashes, chained from the root Attach gave."""
    session = client.attach(LAYOUT)
    acquired = session.acquire(request_id, hashes)
    session.commit(request_id, acquired.block_ids, hashes, token_ids, None)
    session.release(request_id)


def subscribed(daemon, client: KvtierClient) -> zmq.Socket:
    """A SUB socket that has received a batch (ZMQ drops what is published before a subscription
    is up): probe prompts are committed until one arrives."""
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.connect(daemon.kv_events_address)
    sub.subscribe(b"")
    for i in range(100):
        probe = [9000 + 31 * i + j for j in range(BLOCK_SIZE)]
        commit(client, f"probe-{i}", probe, [bytes([i]) * 32])
        if sub.poll(200):
            return sub
    raise AssertionError("no batch reached the subscriber")


def batches_until(sub: zmq.Socket, done, timeout_s: float = 30.0) -> list[tuple[bytes, KVEventBatch]]:
    """(payload, decoded) of every batch received until `done(decoded batches)` holds."""
    received, deadline = [], time.monotonic() + timeout_s
    while time.monotonic() < deadline and not done([batch for _, batch in received]):
        if sub.poll(200):
            topic, seq, payload = sub.recv_multipart()
            assert topic == b"kvtierd" and len(seq) == 8
            received.append((payload, DECODER.decode(payload)))
    return received


def test_published_frames_decode_with_vllms_classes_and_say_what_vllms_own_events_say(daemon):
    """A salted request through vLLM's KVCacheManager and through kvtierd (tenant = the salt):
    vLLM's decoder reads kvtierd's batches, vLLM's encoder writes them back byte for byte, and
    the BlockStored of each tier carries vLLM's hashes, tokens, block size and extra_keys."""
    tokens = [100 + i for i in range(3 * BLOCK_SIZE + 5)]
    request = vllm_request("r", tokens, cache_salt=TENANT)
    [theirs] = [e for e in vllm_own_events(request) if isinstance(e, BlockStored)]
    hashes = [bytes(h) for h in request.block_hashes]
    on_wire = [maybe_convert_block_hash(h) for h in hashes]  # ints: VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1, the default
    assert theirs.block_hashes == on_wire and theirs.extra_keys == [(TENANT,), None, None]
    with KvtierClient(daemon.address, token="a-token") as client:
        sub = subscribed(daemon, client)
        commit(client, "r", tokens[:3 * BLOCK_SIZE], hashes)

        def ours(batches):
            return {e.medium: e for batch in batches for e in batch.events
                    if isinstance(e, BlockStored) and e.block_hashes == on_wire}

        received = batches_until(sub, lambda batches: len(ours(batches)) == 3)
        assert all(msgspec.msgpack.encode(batch) == payload for payload, batch in received)
        stored = ours([batch for _, batch in received])
        assert sorted(stored) == ["CPU", "GPU", "STORAGE"]
        for medium, event in stored.items():
            for field in ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "lora_name",
                          "extra_keys"):
                assert getattr(event, field) == getattr(theirs, field), (medium, field)
        assert theirs.medium == stored["GPU"].medium == "GPU"
        assert all(batch.data_parallel_rank == 0 and batch.ts > 0 for _, batch in received)

        client.evict(tiers=["t0"], layout=LAYOUT)  # the T0 copies leave: BlockRemoved, medium GPU
        removed = batches_until(sub, lambda batches: set(on_wire) <= {
            h for b in batches for e in b.events if isinstance(e, BlockRemoved) for h in e.block_hashes})
        sub.close(linger=0)
    gone = [e for _, b in removed for e in b.events
            if isinstance(e, BlockRemoved) and set(e.block_hashes) & set(on_wire)]
    assert gone and {e.medium for e in gone} == {"GPU"}
    assert set(on_wire) <= {h for e in gone for h in e.block_hashes}


def pool_events(tenant: Tenant, tokens: list[int], hashes: list[bytes], root: bytes) -> PoolEvents:
    keys = tenant.keys(hashes)
    stored = [Stored(key, parent, i, pack_token_ids(tokens[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE]))
              for i, (key, parent) in enumerate(zip(keys, [tenant.key(root), *keys[:-1]]))]
    return PoolEvents(LAYOUT.model_id, BLOCK_SIZE, root, (("GPU", [*stored, Removed(keys[1]), Cleared()]),))


def test_the_positional_format_follows_the_installed_structs_field_order_and_int_hashes_vllms_conversion(
        monkeypatch):
    """format = "array" lists each event's fields in vLLM's declaration order (BlockStored's
    __struct_fields__); hashes are what vLLM's maybe_convert_block_hash makes of them, with
    VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES on (ints, the default) and off (bytes)."""
    tokens = [7 + i for i in range(2 * BLOCK_SIZE)]
    request = vllm_request("p", tokens, cache_salt=None)
    hashes, root = [bytes(h) for h in request.block_hashes], b"\x01" * 32
    events = pool_events(Tenant.named(TENANT), tokens, hashes, root)

    def encoded(**wire) -> bytes:
        return BatchEncoder(WireFormat(**wire), lambda tag: TENANT).encode(events, 1.0)

    def plain(value):  # as an untyped decode gives it: tuples are lists
        return msgspec.msgpack.decode(msgspec.msgpack.encode(value))

    as_map, as_array = DECODER.decode(encoded()), msgspec.msgpack.decode(encoded(format="array"))
    assert [type(e) for e in as_map.events] == [BlockStored, BlockRemoved, AllBlocksCleared]
    assert as_map.events[0].extra_keys == [(TENANT,), None]
    for event, positional in zip(as_map.events, as_array[1], strict=True):
        fields = type(event).__struct_fields__[:len(positional) - 1]
        assert positional == [type(event).__name__, *(plain(getattr(event, f)) for f in fields)]
    assert [len(p) for p in as_array[1]] == [9, 3, 1]  # up to extra_keys; up to medium; the tag
    assert as_map.events[0].block_hashes == [maybe_convert_block_hash(h) for h in hashes]  # the default: ints
    assert as_map.events[1].block_hashes == [maybe_convert_block_hash(hashes[1])]
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "0")
    as_bytes = DECODER.decode(encoded(int_block_hashes=False))
    assert as_bytes.events[0].block_hashes == [maybe_convert_block_hash(h) for h in hashes] == hashes
