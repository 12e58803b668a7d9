"""The KV event feed of a real `kvtierd serve`, read by an independent subscriber (plain pyzmq and
msgpack, no kvtierd code): vLLM's frames, sequence numbers, the replay socket, every tier's
medium, and every tenant's blocks told apart by the salt in extra_keys.
"""

from __future__ import annotations

import os
import stat
import time

import msgpack
import pytest
import zmq

from kvtierd.client import KvtierClient
from kvtierd.events.vllm_events import BatchEncoder, PoolEvents, WireFormat
from kvtierd.events.zmq_publisher import ZmqEventPublisher
from kvtierd.index.index_events import BlockRemoved
from kvtierd.launch.daemon_process import WRITE_THROUGH, DaemonProcess, DaemonStartError, small_daemon_args, wait_until
from kvtierd.node.tenants import Tenant
from tests.server.e2e_runner import LAYOUT, prompt

END_SEQ = (-1).to_bytes(8, "big", signed=True)
EVENTS = ["--set", "events.zmq_endpoint=tcp://127.0.0.1:0", "--set", "events.replay_endpoint=tcp://127.0.0.1:0",
          "--set", "events.topic=kv@node-1@{model}"]


class Subscriber:
    """A SUB on the feed and a DEALER on its replay socket, as a router would hold them."""

    def __init__(self, endpoint: str, replay_endpoint: str, topic: bytes = b"") -> None:
        self.context = zmq.Context()
        self.sub = self.context.socket(zmq.SUB)
        self.sub.connect(endpoint)
        self.sub.subscribe(topic)
        self.replay_socket = self.context.socket(zmq.DEALER)
        self.replay_socket.connect(replay_endpoint)

    def recv(self, timeout_s: float = 10.0) -> tuple[bytes, int, bytes] | None:
        if not self.sub.poll(int(timeout_s * 1000)):
            return None
        topic, seq, payload = self.sub.recv_multipart()
        assert len(seq) == 8
        return topic, int.from_bytes(seq, "big"), payload

    def replay(self, start_seq: int) -> list[tuple[bytes, int, bytes]]:
        """Every buffered batch from start_seq, as vLLM's replay protocol answers."""
        self.replay_socket.send_multipart((b"", start_seq.to_bytes(8, "big")))
        batches = []
        while self.replay_socket.poll(10_000):
            delimiter, topic, seq, payload = self.replay_socket.recv_multipart()
            assert delimiter == b""
            if seq == END_SEQ:
                assert (topic, payload) == (b"", b"")
                return batches
            batches.append((topic, int.from_bytes(seq, "big"), payload))
        raise AssertionError("no end-of-replay marker")

    def close(self) -> None:
        self.context.destroy(linger=0)


def events_of(payload: bytes) -> list[dict]:
    ts, events, data_parallel_rank = msgpack.unpackb(payload)
    assert isinstance(ts, float) and data_parallel_rank == 0
    return events


def stored(batches, medium: str | None = None) -> list[dict]:
    return [e for _, _, payload in batches for e in events_of(payload)
            if e["type"] == "BlockStored" and (medium is None or e["medium"] == medium)]


def u64(block_hash: bytes) -> int:
    """A hash as the feed sends it by default, as vLLM does: its last 8 bytes, big-endian."""
    return int.from_bytes(block_hash[-8:], "big")


def commit(client: KvtierClient, request_id: str, tokens: list[int]) -> list[int]:
    """Acquire, commit and release a prompt's blocks, as a runner does; returns their hashes as
    the feed shows them."""
    session = client.attach(LAYOUT)
    hashes = session.namespace.hash_blocks(tokens)
    acquired = session.acquire(request_id, hashes)
    session.commit(request_id, acquired.block_ids, hashes, tokens, None)
    session.release(request_id)
    return [u64(h) for h in hashes]


def replay_until(subscriber: Subscriber, predicate, timeout_s: float = 20.0):
    """The replay from seq 0 once `predicate(batches)` holds (the publisher thread runs apart)."""
    deadline = time.monotonic() + timeout_s
    while True:
        batches = subscriber.replay(0)
        if predicate(batches) or time.monotonic() > deadline:
            return batches
        time.sleep(0.05)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    directory = tmp_path_factory.mktemp("kvtierd")
    tokens_file = directory / "tokens"
    tokens_file.write_text("acme a-token\nglobex g-token\n")
    args = small_daemon_args(str(directory), extra=[*EVENTS, *WRITE_THROUGH, "--tokens-file", str(tokens_file)])
    with DaemonProcess(args) as process:
        yield process


@pytest.fixture
def subscriber(daemon):
    subscriber = Subscriber(daemon.kv_events_address, daemon.kv_replay_address)
    yield subscriber
    subscriber.close()


def test_a_late_subscriber_gets_increasing_seqs_and_the_replay_returns_what_it_missed(daemon):
    """Batches on the PUB socket are (topic, 8-byte big-endian seq, payload); the replay returns
    every buffered batch from seq 0, byte for byte what was published, then the end marker."""
    assert daemon.kv_events_address.startswith("tcp://127.0.0.1:") and not daemon.kv_events_address.endswith(":0")
    early = Subscriber(daemon.kv_events_address, daemon.kv_replay_address)
    late = None
    try:
        with KvtierClient(daemon.address, token="a-token") as client:
            missed = commit(client, "missed", prompt(31, 8))
            published = replay_until(early, lambda b: missed[0] in [h for e in stored(b) for h in e["block_hashes"]])
            late = Subscriber(daemon.kv_events_address, daemon.kv_replay_address)  # connects after: misses it
            live = []
            for i in range(200):  # until the subscription is up (ZMQ's slow joiner), then two more batches
                commit(client, f"live-{i}", prompt(100 + i, 4))
                while (received := late.recv(timeout_s=0.2)) is not None:
                    live.append(received)
                if len(live) >= 2:
                    break
            assert len(live) >= 2, "the subscriber received nothing"
        seqs = [seq for _, seq, _ in live]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs))) and seqs[0] >= len(published)
        assert {topic for topic, _, _ in live} == {b"kv@node-1@" + LAYOUT.model_id.encode()}
        replayed = late.replay(0)
        assert [seq for _, seq, _ in replayed] == list(range(len(replayed)))
        assert [b for b in replayed if b[1] in seqs] == live  # the same bytes again
        assert replayed[:len(published)] == published
        assert missed[0] in [h for e in stored(replayed[:seqs[0]], "GPU") for h in e["block_hashes"]]
        from_last = late.replay(seqs[-1])  # T1/T2 copies may have published more since
        assert from_last[:len(replayed) - seqs[-1]] == replayed[seqs[-1]:] and from_last[0][1] == seqs[-1]
    finally:
        early.close()
        if late is not None:
            late.close()


def test_every_tenants_blocks_are_on_the_feed_told_apart_by_the_salt_on_each_tier(daemon, subscriber):
    """Two tenants, one prompt: equal client hashes, and extra_keys name each chain's tenant on
    its first block, in T0 (GPU), T1 (CPU) and T2 (STORAGE) alike."""
    tokens = prompt(41, 8)
    with KvtierClient(daemon.address, token="a-token") as acme, KvtierClient(daemon.address, token="g-token") as globex:
        hashes = commit(acme, "salted", tokens)
        assert commit(globex, "salted", tokens) == hashes

    def chains(batches):
        return [(e["medium"], e["extra_keys"][0][0]) for e in stored(batches)
                if e["block_hashes"][0] == hashes[0] and e["extra_keys"][0]]

    media = {(medium, tenant) for medium in ("GPU", "CPU", "STORAGE") for tenant in ("acme", "globex")}
    batches = replay_until(subscriber, lambda batches: set(chains(batches)) == media)
    assert set(chains(batches)) == media
    for event in stored(batches):
        if event["block_hashes"][0] == hashes[0]:
            assert event["parent_block_hash"] is None and event["block_hashes"] == hashes
            assert event["token_ids"] == tokens and event["block_size"] == LAYOUT.block_size
            assert event["extra_keys"][1:] == [None] * (len(hashes) - 1)


def test_a_req_socket_as_in_vllms_example_gets_the_replay_frames(daemon):
    """vLLM's subscriber example asks with a REQ socket; the first reply is (topic, seq, payload)."""
    with KvtierClient(daemon.address, token="a-token") as client:
        commit(client, "req", prompt(51, 4))
    context = zmq.Context()
    try:
        req = context.socket(zmq.REQ)
        req.connect(daemon.kv_replay_address)
        req.send((0).to_bytes(8, "big"))
        assert req.poll(10_000)
        topic, seq, payload = req.recv_multipart()
        assert topic.startswith(b"kv@node-1@") and seq == (0).to_bytes(8, "big") and events_of(payload)
    finally:
        context.destroy(linger=0)


def test_an_endpoint_in_use_fails_the_start_with_a_clear_message(daemon, tmp_path):
    taken = ["--set", f"events.zmq_endpoint={daemon.kv_events_address}"]
    with pytest.raises(DaemonStartError, match="cannot publish KV events: Address already in use"):
        DaemonProcess(small_daemon_args(str(tmp_path), extra=taken))


def test_a_non_loopback_endpoint_is_refused_at_start(tmp_path):
    with pytest.raises(DaemonStartError, match="events.zmq_endpoint 'tcp://0.0.0.0:5557' is not a loopback"):
        DaemonProcess(small_daemon_args(str(tmp_path), extra=["--set", "events.zmq_endpoint=tcp://0.0.0.0:5557"]))


def test_an_ipc_endpoint_is_mode_0600_and_the_feed_is_off_by_default(tmp_path):
    path = tmp_path / "events.sock"
    with DaemonProcess(small_daemon_args(str(tmp_path), extra=["--set", f"events.zmq_endpoint=ipc://{path}"])) as d:
        assert d.kv_events_address == f"ipc://{path}" and d.kv_replay_address is None
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    with DaemonProcess(small_daemon_args(str(tmp_path / "off"))) as d:
        assert d.kv_events_address is None and "kv events: off" in d.output()


def test_a_full_queue_drops_without_waiting_and_the_pools_next_batch_starts_with_all_blocks_cleared():
    """The loop's side only queues: past max_queued_events a batch is dropped and counted, and the
    next batch accepted for that pool tells routers to forget its blocks (vLLM's protocol has no
    "events lost"), after the batches queued before the drop."""
    tenant = Tenant.named("acme")

    def batch(model_id: str, *names: bytes) -> PoolEvents:
        return PoolEvents(model_id, 4, b"r" * 32, (("GPU", [BlockRemoved(tenant.key(n * 32)) for n in names]),))

    publisher = ZmqEventPublisher(BatchEncoder(WireFormat(), str), "tcp://127.0.0.1:0", "tcp://127.0.0.1:0",
                                  max_queued_events=3)
    assert publisher.publish(batch("m", b"a", b"b")) is True
    assert publisher.publish(batch("m", b"c", b"d")) is False and publisher.num_dropped_events == 2
    assert publisher.publish(batch("other", b"e")) is True  # another pool lost nothing
    assert publisher.publish(batch("m", b"f")) is False  # still full: 3 queued
    publisher.start()
    subscriber = Subscriber(publisher.endpoint, publisher.replay_endpoint)
    try:
        assert wait_until(lambda: publisher.num_published_batches == 2, timeout_s=10)
        assert publisher.publish(batch("m", b"g")) is True
        assert wait_until(lambda: publisher.num_published_batches == 3, timeout_s=10)
        replayed = [[e["type"] for e in events_of(payload)] for _, _, payload in subscriber.replay(0)]
    finally:
        subscriber.close()
        publisher.stop()
    assert replayed == [["BlockRemoved"], ["BlockRemoved"], ["AllBlocksCleared", "BlockRemoved"]]
    assert publisher.num_dropped_events == 3
