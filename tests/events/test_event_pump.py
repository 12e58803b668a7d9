"""The event feed's pump wakes on a pool's doorbell: an idle daemon does not poll its pools."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from kvtierd.events.event_feed import EventFeed
from kvtierd.node.tenants import Tenant
from kvtierd.v1 import kvtier_pb2 as pb
from tests.factories import BLOCK_SIZE, NAMESPACE, make_index, tokens

ACME = Tenant.named("acme")
ROOT = ACME.key(NAMESPACE.root)  # the index holds the daemon's keys: tenant tag + client hash
PERIOD_S = 0.01


def test_the_pump_runs_once_at_start_then_only_when_a_pool_queued_events():
    """Ten idle periods: no pump after the first; a commit on another thread wakes the pump, and a
    subscriber reads the stored block."""
    index = make_index(4, max_pending_events=100, hash_size=len(ROOT), root=ROOT)
    pool = SimpleNamespace(layout=NAMESPACE.layout, client_root=NAMESPACE.root, manager=SimpleNamespace(index=index))
    registry = SimpleNamespace(pools=lambda: [pool])
    prompt = tokens(7, BLOCK_SIZE)
    key = ACME.key(NAMESPACE.hash_blocks(prompt)[0])

    def commit() -> None:  # a client's Commit, as the core runs it
        index.allocate("r", [key], 0, prompt)
        index.commit("r", 0, key, prompt, ROOT)

    async def scenario() -> tuple[int, int, pb.Event]:
        feed = EventFeed(registry, period_s=PERIOD_S)  # type: ignore[arg-type]  # only pools() is used
        feed.watch(pool)  # type: ignore[arg-type]
        num_pumps = 0
        pump_once = feed.pump_once

        def counted() -> int:
            nonlocal num_pumps
            num_pumps += 1
            return pump_once()

        feed.pump_once = counted
        subscription = feed.subscribe(ACME, None)
        pumping = asyncio.create_task(feed.run())
        await asyncio.sleep(10 * PERIOD_S)  # idle: a polling pump would have run about ten times
        num_idle_pumps = num_pumps
        await asyncio.to_thread(commit)
        event = await asyncio.wait_for(subscription.next(), 10)
        pumping.cancel()
        return num_idle_pumps, num_pumps, event

    num_idle_pumps, num_pumps, event = asyncio.run(scenario())
    assert num_idle_pumps == 1 and num_pumps == 2
    assert (event.kind, event.block_hash, event.seq) == (pb.Event.STORED, key[len(ACME.tag):], 1)


def test_events_queued_before_the_pump_starts_are_pumped_at_its_start():
    """A pool that queued events before `watch` and `run` (no ring could reach the loop) loses none."""
    index = make_index(4, max_pending_events=100, hash_size=len(ROOT), root=ROOT)
    pool = SimpleNamespace(layout=NAMESPACE.layout, client_root=NAMESPACE.root, manager=SimpleNamespace(index=index))
    prompt = tokens(11, BLOCK_SIZE)
    key = ACME.key(NAMESPACE.hash_blocks(prompt)[0])
    index.allocate("r", [key], 0, prompt)
    index.commit("r", 0, key, prompt, ROOT)

    async def scenario() -> pb.Event:
        feed = EventFeed(SimpleNamespace(pools=lambda: [pool]), period_s=PERIOD_S)  # type: ignore[arg-type]
        feed.watch(pool)  # type: ignore[arg-type]
        subscription = feed.subscribe(ACME, None)
        pumping = asyncio.create_task(feed.run())
        event = await asyncio.wait_for(subscription.next(), 10)
        pumping.cancel()
        return event

    assert asyncio.run(scenario()).block_hash == key[len(ACME.tag):]
