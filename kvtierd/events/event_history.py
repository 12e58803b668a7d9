"""The Events stream's history: the last `max_events` events of every tenant and pool, each with
its sequence number, so that a subscriber reads from its own cursor, resumes after a reconnect,
and learns exactly when events meant for it are gone.

Sequence numbers start at 1 and grow by one per event (of any tenant or pool). The history is a
window `(trimmed_seq, last_seq]`; for each (pool, tenant tag) it remembers the last seq it
trimmed (tag None: a pool-wide CLEARED), so "did this subscriber lose anything after its cursor"
is exact, not "did anyone's events leave": a quiet tenant is not told it lost the others'.

An entry keeps how to make its message, not the message: most events are never read (no
subscriber, or not theirs), and a protobuf message costs more than the block's other bookkeeping.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable

from kvtierd.layout import Layout
from kvtierd.v1 import kvtier_pb2 as pb


@dataclasses.dataclass(frozen=True, slots=True)
class Entry:
    seq: int
    layout: Layout
    tag: bytes | None  # the owning tenant's tag; None: every tenant's (CLEARED)
    make_message: Callable[[], pb.Event]  # a new message without seq and feed_id at each call

    def message(self, feed_id: int) -> pb.Event:
        message = self.make_message()
        message.seq, message.feed_id = self.seq, feed_id
        return message


@dataclasses.dataclass(frozen=True, slots=True)
class Reader:
    """Whose events a subscriber sees: one tenant's, of one pool or (layout None) all."""

    tag: bytes
    layout: Layout | None

    def sees(self, layout: Layout, tag: bytes | None) -> bool:
        return (self.layout is None or self.layout == layout) and (tag is None or tag == self.tag)


class EventHistory:
    """Invariants: entries hold seqs trimmed_seq + 1 .. last_seq in order; every trimmed entry's
    (layout, tag) has its seq (or a later trimmed one) in `_trimmed_seq_of`. Loop thread only."""

    def __init__(self, max_events: int, feed_id: int) -> None:
        assert max_events > 0
        self.max_events = max_events
        self.feed_id = feed_id
        self.last_seq = 0
        self.trimmed_seq = 0
        self._entries: collections.deque[Entry] = collections.deque()
        self._trimmed_seq_of: dict[tuple[Layout, bytes | None], int] = {}

    def append(self, layout: Layout, tag: bytes | None, make_message: Callable[[], pb.Event]) -> None:
        """The next event, of `layout`'s pool and the tenant of `tag`; `make_message` makes its message
        (without seq and feed_id), once for each reader that reads it."""
        self.last_seq += 1
        self._entries.append(Entry(self.last_seq, layout, tag, make_message))
        if len(self._entries) > self.max_events:
            old = self._entries.popleft()
            self.trimmed_seq = old.seq
            self._trimmed_seq_of[old.layout, old.tag] = old.seq

    def lost_after(self, reader: Reader, cursor: int) -> bool:
        """Whether an event `reader` sees, with a seq after `cursor`, was trimmed."""
        return cursor < self.trimmed_seq and any(
            seq > cursor and reader.sees(layout, tag) for (layout, tag), seq in self._trimmed_seq_of.items())

    def read(self, reader: Reader, cursor: int) -> tuple[list[pb.Event], int]:
        """The events `reader` sees after `cursor` (a LOST first when some are gone), and the
        cursor after them."""
        out = []
        if cursor < self.trimmed_seq:
            if self.lost_after(reader, cursor):
                out.append(pb.Event(kind=pb.Event.LOST, seq=self.trimmed_seq, feed_id=self.feed_id))
            cursor = self.trimmed_seq
        new = []  # walked from the newest back: a subscriber that keeps up reads only the tail
        for entry in reversed(self._entries):
            if entry.seq <= cursor:
                break
            if reader.sees(entry.layout, entry.tag):
                new.append(entry)
        return out + [entry.message(self.feed_id) for entry in reversed(new)], max(cursor, self.last_seq)

    def start(self, reader: Reader, resume_after_seq: int | None, feed_id: int) -> tuple[list[pb.Event], int]:
        """A subscriber's first events and cursor: from now (no resume), or after `resume_after_seq`
        of feed `feed_id` (0: this feed), with LOST first when that seq is not of this feed."""
        if resume_after_seq is None:
            return [], self.last_seq
        if (feed_id and feed_id != self.feed_id) or resume_after_seq > self.last_seq:
            lost = pb.Event(kind=pb.Event.LOST, seq=self.last_seq, feed_id=self.feed_id)
            return [lost], self.last_seq
        return self.read(reader, resume_after_seq)

