"""gRPC Events of a real `kvtierd serve`: sequence numbers, resuming after a disconnect from the
daemon's history, tenant filtering across the resume, and LOST after a restart."""

from __future__ import annotations

import pytest

from kvtierd.client import KvtierClient
from kvtierd.launch.daemon_process import DaemonProcess, small_daemon_args
from kvtierd.v1 import kvtier_pb2 as pb
from tests.server.e2e_runner import LAYOUT, prompt


def commit(client: KvtierClient, request_id: str, tokens: list[int]) -> list[bytes]:
    session = client.attach(LAYOUT)
    hashes = session.namespace.hash_blocks(tokens)
    acquired = session.acquire(request_id, hashes)
    session.commit(request_id, acquired.block_ids, hashes, tokens, None)
    session.release(request_id)
    return hashes


def take(events, n: int) -> list[pb.Event]:
    return [next(events) for _ in range(n)]


@pytest.fixture
def tenants(tmp_path):
    tokens_file = tmp_path / "tokens"
    tokens_file.write_text("acme a-token\nglobex g-token\n")
    return small_daemon_args(str(tmp_path), extra=["--tokens-file", str(tokens_file)])


def test_a_resumed_stream_gets_what_it_missed_and_only_its_tenants(tenants):
    """Events have increasing seqs; after a disconnect, resume_after_seq returns the caller's
    events committed meanwhile (another tenant's leave gaps in the seqs), and no LOST."""
    with DaemonProcess(tenants) as daemon:
        with KvtierClient(daemon.address, token="a-token") as acme, \
                KvtierClient(daemon.address, token="g-token") as globex:
            events = acme.events(LAYOUT, timeout_s=60, resume_after_seq=0)  # from the feed's start: no race
            first = commit(acme, "first", prompt(1, 8))
            before = take(events, 2)
            events.cancel()
            assert [e.block_hash for e in before] == first and before[1].seq == before[0].seq + 1
            last_seq, feed_id = events.last_seq, events.feed_id
            assert last_seq == before[1].seq and feed_id != 0
            commit(globex, "theirs", prompt(2, 8))  # 2 events of another tenant
            missed = commit(acme, "missed", prompt(3, 8))
            resumed = acme.events(LAYOUT, timeout_s=60, resume_after_seq=last_seq, feed_id=feed_id)
            after = take(resumed, 2)
            resumed.cancel()
    assert [(e.kind, e.block_hash) for e in after] == [(pb.Event.STORED, h) for h in missed]
    assert [e.seq for e in after] == [last_seq + 3, last_seq + 4] and {e.feed_id for e in after} == {feed_id}


def test_resuming_a_restarted_daemons_feed_starts_with_lost(tenants):
    """A restarted daemon draws a new feed id; a stream resuming the old one is told LOST first,
    then gets new events."""
    with DaemonProcess(tenants) as daemon, KvtierClient(daemon.address, token="a-token") as client:
        events = client.events(LAYOUT, timeout_s=60, resume_after_seq=0)
        commit(client, "r", prompt(4, 4))
        last = take(events, 1)[0]
        events.cancel()
    with DaemonProcess(tenants) as daemon, KvtierClient(daemon.address, token="a-token") as client:
        resumed = client.events(LAYOUT, timeout_s=60, resume_after_seq=last.seq, feed_id=last.feed_id)
        lost = next(resumed)
        fresh = commit(client, "r", prompt(5, 4))
        stored = next(resumed)
        resumed.cancel()
    assert lost.kind == pb.Event.LOST and lost.feed_id not in (0, last.feed_id)
    assert (stored.kind, stored.block_hash, stored.feed_id) == (pb.Event.STORED, fresh[0], lost.feed_id)
    assert stored.seq > lost.seq
