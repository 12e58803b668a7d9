"""The Events stream's history and feed, in process: sequence numbers, per-tenant reading, resume,
and LOST exactly when a subscriber's own events were trimmed."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtierd.daemon_key import TAG_BYTES
from kvtierd.events.event_feed import EventFeed
from kvtierd.events.event_history import EventHistory, Reader
from kvtierd.layout import Layout
from kvtierd.node.tenants import Tenant
from kvtierd.v1 import kvtier_pb2 as pb

POOL_A, POOL_B = Layout("model-a", 2, 2, 16, 4), Layout("model-b", 2, 2, 16, 4)
ACME, GLOBEX = Tenant.named("acme"), Tenant.named("globex")


def stored(name: bytes) -> Callable[[], pb.Event]:
    return lambda: pb.Event(kind=pb.Event.STORED, block_hash=name)


def names(events) -> list[bytes]:
    return [e.block_hash for e in events]


def test_seqs_count_every_event_and_a_reader_sees_its_tenant_its_pool_and_cleared():
    history = EventHistory(100, feed_id=7)
    history.append(POOL_A, ACME.tag, stored(b"a1"))
    history.append(POOL_A, GLOBEX.tag, stored(b"g1"))
    history.append(POOL_B, ACME.tag, stored(b"a2"))
    history.append(POOL_A, None, lambda: pb.Event(kind=pb.Event.CLEARED))
    everything, cursor = history.read(Reader(ACME.tag, None), 0)
    assert [(e.block_hash, e.seq, e.feed_id) for e in everything] == [(b"a1", 1, 7), (b"a2", 3, 7), (b"", 4, 7)]
    assert cursor == 4 and history.read(Reader(ACME.tag, None), cursor) == ([], 4)
    assert names(history.read(Reader(ACME.tag, POOL_B), 0)[0]) == [b"a2"]
    assert names(history.read(Reader(GLOBEX.tag, POOL_A), 1)[0]) == [b"g1", b""]


def test_resume_gets_what_was_missed_and_lost_only_when_the_readers_own_events_were_trimmed():
    """A quiet tenant is not told it lost the others' events; a busy one is, once, then goes on."""
    history = EventHistory(3, feed_id=7)
    history.append(POOL_A, ACME.tag, stored(b"a1"))  # seq 1
    for i in range(4):
        history.append(POOL_A, GLOBEX.tag, stored(b"g%d" % i))  # seqs 2..5; a1 and g0 trimmed
    acme, globex = Reader(ACME.tag, None), Reader(GLOBEX.tag, None)
    assert history.trimmed_seq == 2 and history.last_seq == 5
    lost, cursor = history.start(acme, resume_after_seq=0, feed_id=7)
    assert [e.kind for e in lost] == [pb.Event.LOST] and lost[0].seq == 2 and cursor == 5
    assert history.start(acme, resume_after_seq=1, feed_id=7) == ([], 5)  # it had a1: nothing of its own is gone
    assert names(history.start(globex, resume_after_seq=2, feed_id=7)[0]) == [b"g1", b"g2", b"g3"]
    events, _ = history.start(globex, resume_after_seq=1, feed_id=0)  # g0 is gone
    assert [e.kind for e in events] == [pb.Event.LOST] + [pb.Event.STORED] * 3
    assert history.start(acme, resume_after_seq=None, feed_id=0) == ([], 5)  # no resume: new events only


@pytest.mark.parametrize("resume_after_seq, feed_id", [(3, 8), (99, 7), (99, 0)])
def test_resuming_another_feed_or_a_seq_never_sent_is_lost(resume_after_seq, feed_id):
    """A restarted daemon counts from 1 again: its seqs say nothing about the old feed's."""
    history = EventHistory(10, feed_id=7)
    for i in range(5):
        history.append(POOL_A, ACME.tag, stored(b"a%d" % i))
    events, cursor = history.start(Reader(ACME.tag, None), resume_after_seq, feed_id)
    assert [(e.kind, e.seq, e.feed_id) for e in events] == [(pb.Event.LOST, 5, 7)] and cursor == 5


@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 1)), max_size=40), st.integers(1, 12),
       st.integers(0, 40), st.integers(0, 1), st.sampled_from([None, POOL_A]))
def test_a_resumed_reader_gets_exactly_its_held_events_and_lost_iff_one_of_its_own_was_trimmed(
        appends, max_events, resume_after_seq, reader_tenant, reader_layout):
    """Against a model that keeps every event: the held ones after the cursor, in order, and LOST
    exactly when one of the reader's events after the cursor is no longer held."""
    tags = [bytes([i]) * TAG_BYTES for i in range(3)]
    layouts = [POOL_A, POOL_B]
    history = EventHistory(max_events, feed_id=1)
    log = []
    for tenant, pool in appends:
        tag = tags[tenant] if tenant < 2 else None  # 2: a CLEARED
        history.append(layouts[pool], tag, stored(b"%d" % len(log)))
        log.append((len(log) + 1, layouts[pool], tag))
    reader = Reader(tags[reader_tenant], reader_layout)
    if resume_after_seq > len(log):
        return  # covered by test_resuming_another_feed_or_a_seq_never_sent_is_lost
    events, cursor = history.start(reader, resume_after_seq, 1)
    mine = [seq for seq, layout, tag in log if seq > resume_after_seq and reader.sees(layout, tag)]
    held = [seq for seq in mine if seq > len(log) - max_events]
    kinds = [e.kind for e in events]
    assert kinds == [pb.Event.LOST] * (len(held) < len(mine)) + [pb.Event.STORED] * len(held)
    assert [e.seq for e in events if e.kind != pb.Event.LOST] == held and cursor == len(log)


class FakeIndex:
    def __init__(self) -> None:
        self.pending = []

    def take_events(self):
        events, self.pending = self.pending, []
        return events


def test_a_subscription_waits_for_the_pump_and_reads_from_its_cursor():
    """`next()` blocks until the pump appends, then yields only its tenant's events, in seq order."""
    from kvtierd.index.index_events import BlockStored

    class Pool:
        layout, client_root = POOL_A, b"r" * 32

        class manager:
            index = FakeIndex()

    class Registry:
        def pools(self):
            return [Pool]

    async def scenario():
        feed = EventFeed(Registry(), feed_id=5)
        subscription = feed.subscribe(ACME, None)
        reading = asyncio.ensure_future(subscription.next())
        await asyncio.sleep(0)
        assert not reading.done()
        Pool.manager.index.pending = [BlockStored(GLOBEX.key(b"g" * 32), None, 0),
                                      BlockStored(ACME.key(b"a" * 32), ACME.key(b"r" * 32), 1)]
        assert feed.pump_once() == 2
        first = await asyncio.wait_for(reading, 5)
        return first, feed.history.last_seq

    first, last_seq = asyncio.run(scenario())
    assert (first.kind, first.block_hash, first.parent_hash, first.seq, first.feed_id) == (
        pb.Event.STORED, b"a" * 32, b"r" * 32, 2, 5) and last_seq == 2


def test_a_message_is_made_only_for_a_reader_that_reads_its_event():
    made: list[bytes] = []

    def counted(name: bytes) -> Callable[[], pb.Event]:
        def make() -> pb.Event:
            made.append(name)
            return pb.Event(kind=pb.Event.STORED, block_hash=name)
        return make

    history = EventHistory(100, feed_id=7)
    for i in range(50):  # no subscriber: nothing is made
        history.append(POOL_A, (ACME if i % 2 else GLOBEX).tag, counted(b"%d" % i))
    assert made == []
    events, _ = history.read(Reader(ACME.tag, POOL_A), 0)
    assert made == names(events) == [b"%d" % i for i in range(1, 50, 2)]
    assert [e.seq for e in events] == list(range(2, 51, 2))
