"""The event feed: every pool's index events, drained by one pump, to the Events stream and to the
KV event publisher (ZMQ, vLLM's wire format) when one is on.

A pump drains each pool's device-tier event queue (take_events is atomic) into the history
(event_history.py): each event gets the next sequence number, and every Events subscriber reads
from its own cursor there, seeing only its own tenant's blocks (with the tenant prefix taken off)
and the pool-wide CLEARED. Nothing is queued per subscriber: one that does not
keep up falls behind the bounded history and gets LOST, never unbounded memory.

The pump runs when there is something to drain: each pool's event queues ring the feed's doorbell
when they go from empty to not empty (index_events.EventQueue), and the pump then drains every
pool, at most once per `period_s` (the events of a busy period go out together). An idle daemon
wakes for no event, and a busy one wakes no more often than the period.

With a publisher, the same pump also hands it each pool's events of every tenant, the host (T1)
and SSD (T2) tiers' too when `lower_tiers`: their slot indexes queue events only from the
moment `watch` switches them on, as each pool is created.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import secrets
from typing import TYPE_CHECKING

from kvtierd.daemon_key import client_hash_of, tenant_tag_of
from kvtierd.events.event_history import EventHistory, Reader
from kvtierd.events.vllm_events import MEDIUM_CPU, MEDIUM_GPU, MEDIUM_STORAGE, PoolEvents
from kvtierd.index.index_events import AllBlocksCleared, BlockRemoved, BlockStored, IndexEvent
from kvtierd.layout import Layout
from kvtierd.node.pools import MAX_PENDING_EVENTS, LayoutPool, PoolRegistry
from kvtierd.node.tenants import Tenant
from kvtierd.v1 import kvtier_pb2 as pb

if TYPE_CHECKING:  # pyzmq loads only where the [events] feed is on (serve.py builds the publisher)
    from kvtierd.events.zmq_publisher import ZmqEventPublisher

log = logging.getLogger(__name__)

HISTORY_EVENTS = 65536  # device-tier events held for resuming subscribers, of every tenant


class Subscription:
    """One Events stream: its reader and cursor into the history, and what it read but has not sent."""

    def __init__(self, feed: EventFeed, reader: Reader, first: list[pb.Event], cursor: int) -> None:
        self._feed = feed
        self._reader = reader
        self._pending = list(reversed(first))  # popped from the end
        self.cursor = cursor

    async def next(self) -> pb.Event:
        while not self._pending:
            events, self.cursor = self._feed.history.read(self._reader, self.cursor)
            if events:
                self._pending = events[::-1]
                break
            await self._feed.wait_for_events()  # no await between the read and this: no lost wake-up
        return self._pending.pop()


class EventFeed:
    def __init__(self, registry: PoolRegistry, period_s: float = 0.02, publisher: ZmqEventPublisher | None = None,
                 lower_tiers: bool = False, history_events: int = HISTORY_EVENTS, feed_id: int | None = None) -> None:
        self.registry = registry
        self.period_s = period_s
        self.publisher = publisher  # None: no KV event feed
        self.lower_tiers = lower_tiers and publisher is not None
        self.history = EventHistory(history_events, feed_id or secrets.randbits(63) or 1)
        self._appended = asyncio.Event()  # set, then replaced, when the history grows
        self._due = asyncio.Event()  # set (on the loop) once some pool queued events since the last pump
        self._loop: asyncio.AbstractEventLoop | None = None  # run's, once it runs

    def watch(self, pool: LayoutPool) -> None:
        """Pump when a new pool queues events, and switch on its T1/T2 events when `lower_tiers`
        (PoolRegistry.on_created; any thread)."""
        pool.manager.index.set_event_doorbell(self._ring)
        if self.lower_tiers:
            tiers = pool.manager.tiers
            for tier in (tiers.host, tiers.ssd):
                if tier is not None:
                    tier.enable_events(MAX_PENDING_EVENTS, self._ring)

    def _ring(self) -> None:
        """The pools' doorbell (any thread, under an index lock): wake the pump. Before `run` has
        started, nothing: its first pump drains whatever was queued."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._due.set)

    def subscribe(self, tenant: Tenant, layout: Layout | None, resume_after_seq: int | None = None,
                  feed_id: int = 0) -> Subscription:
        reader = Reader(tenant.tag, layout)
        first, cursor = self.history.start(reader, resume_after_seq, feed_id)
        return Subscription(self, reader, first, cursor)

    async def wait_for_events(self) -> None:
        await self._appended.wait()

    def pump_once(self) -> int:
        """Move every pending index event to the history and the publisher; returns how many
        events were read."""
        num_events = 0
        for pool in self.registry.pools():
            events = pool.manager.index.take_events()
            num_events += len(events)
            for event in events:
                tag = None if isinstance(event, AllBlocksCleared) else tenant_tag_of(event.block_hash)
                self.history.append(pool.layout, tag, functools.partial(to_message, event, pool.layout.model_id))
            if self.publisher is not None:
                num_events += self._publish(self.publisher, pool, events)
        if num_events:
            self._appended.set()
            self._appended = asyncio.Event()
        return num_events

    def _publish(self, publisher: ZmqEventPublisher, pool: LayoutPool, device_events: list[IndexEvent]) -> int:
        """Hand the pool's events of every tier to the publisher; returns the lower tiers' count."""
        by_medium = [(MEDIUM_GPU, device_events)]
        if self.lower_tiers:
            tiers = pool.manager.tiers
            by_medium += [(medium, tier.take_events()) for medium, tier in
                          ((MEDIUM_CPU, tiers.host), (MEDIUM_STORAGE, tiers.ssd)) if tier is not None]
        pool_events = PoolEvents(pool.layout.model_id, pool.layout.block_size, pool.client_root,
                                 tuple((medium, events) for medium, events in by_medium if events))
        if pool_events.num_events:
            publisher.publish(pool_events)
        return pool_events.num_events - len(device_events)

    async def run(self) -> None:
        """Pump now, then whenever a doorbell rang, at most once per `period_s`."""
        self._loop = asyncio.get_running_loop()
        while True:
            self._due.clear()  # a ring from now on is seen: its set runs on this loop, after the pump
            try:
                self.pump_once()
            except Exception:  # a bad event must not stop the feed for everyone
                log.exception("event pump failed")
            await asyncio.sleep(self.period_s)
            await self._due.wait()


def to_message(event: BlockStored | BlockRemoved | AllBlocksCleared, model_id: str) -> pb.Event:
    if isinstance(event, AllBlocksCleared):
        return pb.Event(kind=pb.Event.CLEARED, model_id=model_id)
    if isinstance(event, BlockStored):
        parent = client_hash_of(event.parent_hash) if event.parent_hash is not None else b""
        return pb.Event(kind=pb.Event.STORED, block_hash=client_hash_of(event.block_hash), parent_hash=parent,
                        block_id=event.block_id, model_id=model_id)
    return pb.Event(kind=pb.Event.REMOVED, block_hash=client_hash_of(event.block_hash), model_id=model_id)
