"""The client library against a fake in-process KvTier servicer: fast failure when the daemon is
down, retries on UNAVAILABLE only, deadlines, the bearer token, Put/Get framing, Attach (pool
mapping, hash-root check) and the KeepAlive stream. The real server is tested end to end elsewhere."""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
import torch

from kvtierd.block_hash import Namespace
from kvtierd.client import AsyncKvtierClient, KvtierClient, PutResult
from kvtierd.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument, KvtierError, Unavailable
from kvtierd.layout import Layout
from kvtierd.t0.factory import create_device_pool
from kvtierd.tier import TierCounts
from kvtierd.token_bytes import pack_token_ids
from kvtierd.v1 import kvtier_pb2 as pb
from kvtierd.v1 import kvtier_pb2_grpc
from kvtierd.wire.conversions import handle_to_proto, layout_from_proto

LAYOUT = Layout("m", 2, 2, 16, 4)
TOKENS = list(range(LAYOUT.block_size))


class FakeKvTier(kvtier_pb2_grpc.KvTierServicer):
    """Records what it receives; each test sets the behaviour it needs."""

    def __init__(self) -> None:
        self.num_calls: Counter[str] = Counter()
        self.metadata: list[dict[str, str]] = []
        self.requests: dict[str, list] = {}
        self.stats_errors: list[tuple[grpc.StatusCode, str]] = []  # raised in order, then answers
        self.always_unavailable = False
        self.sleep_s = 0.0
        self.attach_response = pb.AttachResponse()
        self.get_responses: list[pb.GetResponse] = []
        self.keepalive_abort = False
        self.keepalive_ended = threading.Event()
        self.events_drop_once = False

    def _record(self, name: str, request, context) -> None:
        self.num_calls[name] += 1
        self.metadata.append(dict(context.invocation_metadata()))
        self.requests.setdefault(name, []).append(request)

    def Stats(self, request, context):
        self._record("Stats", request, context)
        if self.always_unavailable:
            context.abort(grpc.StatusCode.UNAVAILABLE, "shutting down")
        if self.stats_errors:
            context.abort(*self.stats_errors.pop(0))
        return pb.StatsResponse(version="fake", num_sessions=3)

    def Attach(self, request, context):
        self._record("Attach", request, context)
        return self.attach_response

    def Lookup(self, request, context):
        self._record("Lookup", request, context)
        time.sleep(self.sleep_s)
        return pb.LookupResponse(num_hit_blocks=2, num_t0_blocks=1, num_t1_blocks=1)

    def Acquire(self, request, context):
        self._record("Acquire", request, context)
        return pb.AcquireResponse(block_ids=[3, 1, 2], num_t0_hit_blocks=1, num_t1_blocks=1, pending=True)

    def Wait(self, request, context):
        self._record("Wait", request, context)
        time.sleep(self.sleep_s)
        return pb.WaitResponse(num_ready_blocks=2)

    def Commit(self, request, context):
        self._record("Commit", request, context)
        return pb.CommitResponse(num_committed_blocks=len(request.block_ids))

    def Release(self, request, context):
        self._record("Release", request, context)
        return pb.ReleaseResponse(num_released_blocks=3)

    def Fork(self, request, context):
        self._record("Fork", request, context)
        return pb.ForkResponse(block_ids=[3, 1])

    def AppendBlocks(self, request, context):
        self._record("AppendBlocks", request, context)
        return pb.AppendBlocksResponse(block_ids=[0] * request.num_blocks)

    def PrepareWrite(self, request, context):
        self._record("PrepareWrite", request, context)
        return pb.PrepareWriteResponse(block_id=7, copied=True)

    def Put(self, request_iterator, context):
        received = list(request_iterator)
        self._record("Put", received, context)
        return pb.PutResponse(num_blocks=len(received), num_already_cached_blocks=1)

    def Get(self, request, context):
        self._record("Get", request, context)
        yield from self.get_responses

    def Events(self, request, context):
        self._record("Events", request, context)
        if self.events_drop_once:  # seqs 4 and 5 of feed 9, then the connection "drops"; then seq 6
            self.events_drop_once = False
            yield pb.Event(kind=pb.Event.STORED, block_hash=b"a" * 32, seq=4, feed_id=9)
            yield pb.Event(kind=pb.Event.STORED, block_hash=b"b" * 32, seq=5, feed_id=9)
            context.abort(grpc.StatusCode.UNAVAILABLE, "connection reset")
        if request.HasField("resume_after_seq"):
            yield pb.Event(kind=pb.Event.STORED, block_hash=b"c" * 32, seq=request.resume_after_seq + 1, feed_id=9)
        yield pb.Event(kind=pb.Event.STORED, block_hash=b"a" * 32, block_id=1, model_id="m")
        yield pb.Event(kind=pb.Event.REMOVED, block_hash=b"a" * 32, model_id="m")
        while context.is_active():
            time.sleep(0.02)

    def KeepAlive(self, request_iterator, context):
        try:
            for request in request_iterator:
                self._record("KeepAlive", request, context)
                yield pb.KeepAliveResponse(lease_s=0.3)
                if self.keepalive_abort:
                    context.abort(grpc.StatusCode.UNAVAILABLE, "daemon stopping")
        finally:
            self.keepalive_ended.set()


@pytest.fixture
def fake():
    return FakeKvTier()


@pytest.fixture
def target(fake, tmp_path):
    """The fake served on a unix socket under tmp_path; yields the client target."""
    server = grpc.server(ThreadPoolExecutor(max_workers=16))
    kvtier_pb2_grpc.add_KvTierServicer_to_server(fake, server)
    address = f"unix://{tmp_path}/kvtierd.sock"
    server.add_insecure_port(address)
    server.start()
    yield address
    server.stop(0)


def attach_response(pool_handle: pb.PoolHandle | None = None, root: bytes | None = None) -> pb.AttachResponse:
    pool_handle = pool_handle or pb.PoolHandle(kind="shm", shm_name="unmapped", num_blocks=4,
                                               nbytes=4 * LAYOUT.bytes_per_block)
    return pb.AttachResponse(session_id="s-1", pool=pool_handle, bytes_per_block=LAYOUT.bytes_per_block,
                             root_hash=Namespace(LAYOUT).root if root is None else root, hash_size=32,
                             lease_s=0.3, tenant="team-a")


def unused_tcp_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def down_targets(tmp_path) -> list[str]:
    return [f"unix://{tmp_path}/missing.sock", f"unix:{tmp_path}/missing.sock", f"127.0.0.1:{unused_tcp_port()}"]


def check_down_error(error: Unavailable, target: str, elapsed_s: float) -> None:
    assert elapsed_s < 2.0, f"a down daemon took {elapsed_s:.2f} s to report"
    assert target in str(error) and "kvtierd serve" in str(error)
    if target.startswith("unix"):
        assert "does not exist" in str(error)
    assert isinstance(error.__cause__, grpc.RpcError)


def test_down_daemon_gives_unavailable_fast(tmp_path):
    """No socket / nothing listening: Unavailable naming the target in < 2 s, not at a deadline."""
    for address in down_targets(tmp_path):
        with KvtierClient(address, timeout_s=10.0) as client:
            start = time.monotonic()
            with pytest.raises(Unavailable) as info:
                client.stats()
            check_down_error(info.value, address, time.monotonic() - start)


def test_down_daemon_gives_unavailable_fast_async(tmp_path):
    """The asyncio client fails as fast, with the same message."""
    async def main():
        for address in down_targets(tmp_path):
            async with AsyncKvtierClient(address, timeout_s=10.0) as client:
                start = time.monotonic()
                with pytest.raises(Unavailable) as info:
                    await client.attach(LAYOUT)
                check_down_error(info.value, address, time.monotonic() - start)
    asyncio.run(main())


def test_unavailable_is_retried_until_the_answer(fake, target):
    """Two UNAVAILABLEs then an answer: the client returns the answer after exactly 3 calls."""
    fake.stats_errors = [(grpc.StatusCode.UNAVAILABLE, "busy")] * 2
    with KvtierClient(target) as client:
        assert client.stats().version == "fake"
    assert fake.num_calls["Stats"] == 3


def test_unavailable_is_retried_until_the_answer_async(fake, target):
    fake.stats_errors = [(grpc.StatusCode.UNAVAILABLE, "busy")] * 2

    async def main():
        async with AsyncKvtierClient(target) as client:
            return await client.stats()
    assert asyncio.run(main()).num_sessions == 3
    assert fake.num_calls["Stats"] == 3


def test_other_codes_are_not_retried_and_keep_the_server_message(fake, target):
    """INVALID_ARGUMENT: one call, InvalidArgument with the server's details, RpcError as cause."""
    fake.stats_errors = [(grpc.StatusCode.INVALID_ARGUMENT, "hash 3 is 31 bytes, expected 32")]
    with KvtierClient(target) as client, pytest.raises(InvalidArgument, match="hash 3 is 31 bytes") as info:
        client.stats()
    assert fake.num_calls["Stats"] == 1
    assert info.value.__cause__.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_unknown_code_maps_to_kvtier_error_naming_it(fake, target):
    fake.stats_errors = [(grpc.StatusCode.DATA_LOSS, "torn")]
    with KvtierClient(target) as client, pytest.raises(KvtierError, match="DATA_LOSS: torn") as info:
        client.stats()
    assert type(info.value) is KvtierError


def test_unavailable_forever_stops_after_max_attempts(fake, target):
    fake.always_unavailable = True
    with KvtierClient(target, max_attempts=3) as client, pytest.raises(Unavailable, match="shutting down"):
        client.stats()
    assert fake.num_calls["Stats"] == 3


def test_slow_call_gives_deadline_exceeded(fake, target):
    """Lookup slower than timeout_s: DeadlineExceeded within timeout + 1 s, and no retry."""
    fake.attach_response, fake.sleep_s = attach_response(), 2.0
    with KvtierClient(target, timeout_s=0.3) as client:
        session = client.attach(LAYOUT, map_pool=False, keepalive=False)
        start = time.monotonic()
        with pytest.raises(DeadlineExceeded):
            session.lookup([b"h" * 32])
        assert time.monotonic() - start < 0.3 + 1.0
    assert fake.num_calls["Lookup"] == 1


def test_wait_deadline_follows_its_timeout(fake, target):
    """wait(timeout_s=1) outlives the client's 0.2 s timeout and tells the daemon 1 s."""
    fake.attach_response, fake.sleep_s = attach_response(), 0.5
    with KvtierClient(target, timeout_s=0.2) as client:
        session = client.attach(LAYOUT, map_pool=False, keepalive=False)
        assert session.wait("r", timeout_s=1.0) == 2
    assert fake.requests["Wait"][0].timeout_s == 1.0


def test_bearer_token_reaches_the_server(fake, target, monkeypatch):
    monkeypatch.setenv("KVTIERD_TOKEN", "from-env")
    with KvtierClient(target, token="s3cret") as client:
        client.stats()
    with KvtierClient(target) as client:
        client.stats()
    monkeypatch.delenv("KVTIERD_TOKEN")
    with KvtierClient(target) as client:
        client.stats()
    assert [m.get("authorization") for m in fake.metadata] == ["Bearer s3cret", "Bearer from-env", None]


def test_target_defaults_to_env_then_socket(monkeypatch):
    monkeypatch.setenv("KVTIERD_ADDRESS", "10.0.0.1:7070")
    with KvtierClient() as client:
        assert client.target == "10.0.0.1:7070"
    monkeypatch.delenv("KVTIERD_ADDRESS")
    with KvtierClient() as client:
        assert client.target.startswith("unix:///") and client.target.endswith(".sock")


def test_put_sends_layout_and_parent_in_the_first_message_only(fake, target):
    """One message per block, in order; bytes, memoryview and tensor data all arrive as bytes."""
    size = LAYOUT.bytes_per_block
    tensor = torch.arange(size // 2, dtype=torch.float16)
    blocks = [(b"0" * 32, TOKENS, b"\x01" * size), (b"1" * 32, np.array(TOKENS), memoryview(b"\x02" * size)),
              (b"2" * 32, torch.tensor(TOKENS), tensor)]
    with KvtierClient(target) as client:
        assert client.put(LAYOUT, iter(blocks), parent_hash=b"p" * 32) == PutResult(3, 1)
    first, *rest = fake.requests["Put"][0]
    assert layout_from_proto(first.layout) == LAYOUT and first.parent_hash == b"p" * 32
    assert all(not m.HasField("layout") and m.parent_hash == b"" for m in rest)
    sent = [first, *rest]
    assert [m.block_hash for m in sent] == [b"0" * 32, b"1" * 32, b"2" * 32]
    assert all(m.token_ids == pack_token_ids(TOKENS) for m in sent)
    assert [m.data for m in sent] == [b"\x01" * size, b"\x02" * size, tensor.numpy().tobytes()]


def test_put_of_a_malformed_block_raises_its_error(fake, target):
    """A short block: InvalidArgument (a list is checked before anything is sent)."""
    good = (b"0" * 32, TOKENS, bytes(LAYOUT.bytes_per_block))
    with KvtierClient(target) as client:
        with pytest.raises(InvalidArgument, match="bytes, got 3"):
            client.put(LAYOUT, [good, (b"1" * 32, TOKENS, b"abc")])
        assert fake.num_calls["Put"] == 0
        with pytest.raises(InvalidArgument, match="bytes, got 3"):
            client.put(LAYOUT, iter([good, (b"1" * 32, TOKENS, b"abc")]))


def test_get_returns_the_leading_blocks_in_order(fake, target):
    fake.get_responses = [pb.GetResponse(block_hash=b"0" * 32, data=b"d0"),
                          pb.GetResponse(block_hash=b"1" * 32, data=b"d1")]
    with KvtierClient(target) as client:
        blocks = client.get(LAYOUT, [b"0" * 32, b"1" * 32, b"2" * 32], token_ids=TOKENS * 3)
    assert blocks == [(b"0" * 32, b"d0"), (b"1" * 32, b"d1")]
    request = fake.requests["Get"][0]
    assert layout_from_proto(request.layout) == LAYOUT and len(request.block_hashes) == 3
    assert request.token_ids == pack_token_ids(TOKENS * 3)


def test_session_calls_build_their_requests_and_read_their_answers(fake, target):
    fake.attach_response = attach_response()
    with KvtierClient(target) as client:
        session = client.attach(LAYOUT, map_pool=False, keepalive=False)
        acquired = session.acquire("r", [b"0" * 32], num_extra_blocks=2, token_ids=torch.tensor(TOKENS))
        assert (acquired.block_ids, acquired.num_t1_blocks, acquired.pending) == ([3, 1, 2], 1, True)
        assert session.lookup([b"0" * 32], prefetch=True).total == TierCounts(t0=1, t1=1)
        assert session.commit("r", [3], [b"0" * 32], TOKENS, None) == 1
        assert session.fork("r", "r2") == [3, 1] and session.append_blocks("r", 2) == [0, 0]
        assert session.prepare_write("r", 1) == (7, True) and session.release("r") == 3
    assert fake.requests["Acquire"][0].token_ids == pack_token_ids(TOKENS)
    assert fake.requests["Acquire"][0].num_extra_blocks == 2 and fake.requests["Lookup"][0].prefetch
    assert fake.requests["Commit"][0].parent_hash == Namespace(LAYOUT).root
    assert {r.session_id for name in ("Acquire", "Commit", "Release") for r in fake.requests[name]} == {"s-1"}


def wait_for(predicate, timeout_s: float = 3.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.02)
    return predicate()


def test_attach_maps_the_pool_and_keeps_the_lease_alive(fake, target):
    """session.pool maps the daemon's bytes; KeepAlive sends the id then pings; close ends it."""
    with create_device_pool(LAYOUT, 4, "cpu") as pool, KvtierClient(target) as client:
        fake.attach_response = attach_response(handle_to_proto(pool.handle))
        session = client.attach(LAYOUT)
        assert (session.session_id, session.tenant, session.lease_s) == ("s-1", "team-a", 0.3)
        assert session.root_hash == session.namespace.root and session.hash_size == 32
        pool.tensor[2].fill_(1.5)
        assert bool((session.pool.tensor[2] == 1.5).all()) and float(session.pool.tensor[1].abs().sum()) == 0
        assert wait_for(lambda: fake.num_calls["KeepAlive"] >= 3)  # pings every 0.1 s
        sent = fake.requests["KeepAlive"]
        assert sent[0].session_id == "s-1" and all(r.session_id == "" for r in sent[1:])
        assert not fake.keepalive_ended.is_set()
        session.close()
        assert fake.keepalive_ended.wait(2.0) and session.pool.closed


def test_attach_refuses_a_daemon_with_another_hash_root(fake, target):
    fake.attach_response = attach_response(root=b"\0" * 32)
    with KvtierClient(target) as client, pytest.raises(FailedPrecondition, match="disagree on the hash root"):
        client.attach(LAYOUT)
    assert fake.num_calls["KeepAlive"] == 0


def test_broken_keepalive_logs_a_warning(fake, target, caplog):
    fake.attach_response, fake.keepalive_abort = attach_response(), True
    with caplog.at_level(logging.WARNING, "kvtierd.client"), KvtierClient(target) as client:
        client.attach(LAYOUT, map_pool=False)
        assert wait_for(lambda: "keepalive of session s-1" in caplog.text)
    assert "reclaim" in caplog.text


def test_async_attach_keeps_the_lease_alive_until_close(fake, target):
    fake.attach_response = attach_response()

    async def main():
        async with AsyncKvtierClient(target) as client:
            session = await client.attach(LAYOUT, map_pool=False)
            assert await asyncio.to_thread(wait_for, lambda: fake.num_calls["KeepAlive"] >= 3)
            assert not fake.keepalive_ended.is_set()
            acquired = await session.acquire("r", [b"0" * 32])
            assert list(acquired.block_ids) == [3, 1, 2] and acquired.pending  # the daemon's answer, decoded
            assert fake.requests["Acquire"][0].session_id == "s-1"
            await session.close()
            assert await asyncio.to_thread(fake.keepalive_ended.wait, 2.0)
    asyncio.run(main())
    assert fake.requests["KeepAlive"][0].session_id == "s-1"


def test_events_stream_resumes_after_its_last_event_when_the_connection_drops(fake, target):
    """UNAVAILABLE after events: the next call asks for what came after the last seq delivered,
    so the caller sees 4, 5, 6 and no error; `last_seq`/`feed_id` say where it stands."""
    fake.events_drop_once = True
    with KvtierClient(target) as client:
        events = client.events(LAYOUT)
        assert [next(events).seq for _ in range(3)] == [4, 5, 6]
        assert (events.last_seq, events.feed_id) == (6, 9)
        events.cancel()
    first, second = fake.requests["Events"]
    assert not first.HasField("resume_after_seq")
    assert (second.resume_after_seq, second.feed_id, second.layout.model_id) == (5, 9, "m")

    async def resume_in_another_stream():
        async with AsyncKvtierClient(target) as aio:
            events = aio.events(resume_after_seq=41, feed_id=9)
            seq = (await events.__anext__()).seq
            events.cancel()
            return seq

    assert asyncio.run(resume_in_another_stream()) == 42
    assert (fake.requests["Events"][-1].resume_after_seq, fake.requests["Events"][-1].feed_id) == (41, 9)


def test_events_stream_ends_on_cancel_and_on_close(fake, target):
    with KvtierClient(target) as client:
        events = client.events(LAYOUT)
        assert [next(events).kind, next(events).kind] == [pb.Event.STORED, pb.Event.REMOVED]
        events.cancel()
        assert list(events) == []
        second = client.events()
        received = []
        reader = threading.Thread(target=lambda: received.extend(second))
        reader.start()
        assert wait_for(lambda: len(received) == 2)
        client.close()
        reader.join(2.0)
        assert not reader.is_alive()


def test_async_put_get_and_events(fake, target):
    """The asyncio client frames Put and Get alike; its event stream ends on cancel()."""
    fake.get_responses = [pb.GetResponse(block_hash=b"0" * 32, data=b"d0")]
    data = bytes(LAYOUT.bytes_per_block)

    async def main():
        async with AsyncKvtierClient(target) as client:
            put = await client.put(LAYOUT, [(b"0" * 32, TOKENS, data), (b"1" * 32, TOKENS, data)])
            blocks = await client.get(LAYOUT, [b"0" * 32])
            with pytest.raises(InvalidArgument):
                await client.put(LAYOUT, iter([(b"0" * 32, TOKENS, data), (b"1" * 32, TOKENS, b"x")]))
            events = client.events()
            kinds = [(await events.__anext__()).kind for _ in range(2)]
            events.cancel()
            return put, blocks, kinds, [event async for event in events]
    put, blocks, kinds, after_cancel = asyncio.run(main())
    assert put == PutResult(2, 1) and blocks == [(b"0" * 32, b"d0")]
    assert kinds == [pb.Event.STORED, pb.Event.REMOVED] and after_cancel == []
    first, second = fake.requests["Put"][0]
    assert first.HasField("layout") and not second.HasField("layout")
