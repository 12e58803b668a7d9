"""The Events stream: device-tier changes of every pool, fanned out to subscribers, each seeing
only its own tenant's blocks (with the tenant prefix taken off) and the pool-wide CLEARED.

A pump drains each pool's block-index event queue every `period_s` (take_events is atomic) and
hands the events to subscriber queues. Queues are bounded: a subscriber that does not keep up
loses its oldest events and the loss is counted, the daemon never buffers without bound.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging

from kvtierd.daemon_key import client_hash_of, tenant_tag_of
from kvtierd.index.index_events import AllBlocksCleared, BlockRemoved, BlockStored
from kvtierd.layout import Layout
from kvtierd.node.pools import PoolRegistry
from kvtierd.node.tenants import Tenant
from kvtierd.v1 import kvtier_pb2 as pb

log = logging.getLogger(__name__)

MAX_QUEUED_EVENTS = 4096


@dataclasses.dataclass(eq=False)
class Subscriber:
    tenant: Tenant
    layout: Layout | None  # None: every pool
    queue: asyncio.Queue
    num_dropped: int = 0

    def offer(self, event: pb.Event) -> None:
        if self.queue.full():
            self.queue.get_nowait()
            self.num_dropped += 1
        self.queue.put_nowait(event)


class EventFeed:
    def __init__(self, registry: PoolRegistry, period_s: float = 0.02) -> None:
        self.registry = registry
        self.period_s = period_s
        self._subscribers: set[Subscriber] = set()

    def subscribe(self, tenant: Tenant, layout: Layout | None) -> Subscriber:
        subscriber = Subscriber(tenant, layout, asyncio.Queue(MAX_QUEUED_EVENTS))
        self._subscribers.add(subscriber)
        return subscriber

    def unsubscribe(self, subscriber: Subscriber) -> None:
        self._subscribers.discard(subscriber)

    def pump_once(self) -> int:
        """Move every pending index event to its subscribers; returns how many events were read."""
        num_events = 0
        for pool in self.registry.pools():
            events = pool.manager.index.take_events()
            num_events += len(events)
            if not self._subscribers or not events:
                continue
            subscribers = [s for s in self._subscribers if s.layout is None or s.layout == pool.layout]
            model_id = pool.layout.model_id
            for event in events:
                if isinstance(event, AllBlocksCleared):
                    message = pb.Event(kind=pb.Event.CLEARED, model_id=model_id)
                    for subscriber in subscribers:
                        subscriber.offer(message)
                    continue
                tag = tenant_tag_of(event.block_hash)
                for subscriber in subscribers:
                    if subscriber.tenant.tag == tag:
                        subscriber.offer(to_message(event, model_id))
        return num_events

    async def run(self) -> None:
        while True:
            try:
                self.pump_once()
            except Exception:  # a bad event must not stop the feed for everyone
                log.exception("event pump failed")
            await asyncio.sleep(self.period_s)


def to_message(event: BlockStored | BlockRemoved, model_id: str) -> pb.Event:
    if isinstance(event, BlockStored):
        parent = client_hash_of(event.parent_hash) if event.parent_hash is not None else b""
        return pb.Event(kind=pb.Event.STORED, block_hash=client_hash_of(event.block_hash), parent_hash=parent,
                        block_id=event.block_id, model_id=model_id)
    return pb.Event(kind=pb.Event.REMOVED, block_hash=client_hash_of(event.block_hash), model_id=model_id)
