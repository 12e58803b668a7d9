"""items_until, the loop under the KeepAlive and Events streams: items until the stream ends or
the daemon stops, and no "Task exception was never retrieved" when a stream's call is cancelled
while it waits and its next item then ends the stream (seen as a StopAsyncIteration logged after
"kvtierd: stopped")."""

from __future__ import annotations

import asyncio
import gc

from kvtierd.server.stream_items import items_until


def stream(items: list, ended: asyncio.Event):
    """next_item of a stream that gives `items`, then waits for `ended` and ends."""
    left = list(items)

    async def next_item():
        if left:
            return left.pop(0)
        await ended.wait()
        raise StopAsyncIteration

    return next_item


def run_collecting_loop_errors(main) -> list[dict]:
    errors = []

    async def wrapper():
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: errors.append(context))
        await main()
        gc.collect()  # a task whose exception nobody retrieved reports it when collected
        await asyncio.sleep(0)

    asyncio.run(wrapper())
    return errors


def test_items_until_the_stream_ends():
    async def main():
        ended = asyncio.Event()
        ended.set()
        return [item async for item in items_until(stream([1, 2, 3], ended), asyncio.Event())]

    assert asyncio.run(main()) == [1, 2, 3]


def test_a_stop_ends_the_items_while_the_stream_waits():
    got = []

    async def main():
        stop, ended = asyncio.Event(), asyncio.Event()

        async def consume():
            async for item in items_until(stream(["a"], ended), stop):
                got.append(item)

        consumer = asyncio.ensure_future(consume())
        while not got:
            await asyncio.sleep(0)
        stop.set()
        await asyncio.wait_for(consumer, 5)
        ended.set()  # the abandoned next_item, cancelled, never ends the stream now

    assert run_collecting_loop_errors(main) == []
    assert got == ["a"]


def test_a_cancelled_call_leaves_no_unretrieved_exception_when_its_stream_then_ends():
    async def main():
        ended = asyncio.Event()
        started = asyncio.Event()

        async def next_item():
            started.set()
            try:
                await ended.wait()
            except asyncio.CancelledError:
                pass  # a stream that finishes anyway when cancelled, as grpc.aio's request iterator may
            raise StopAsyncIteration

        async def consume():
            async for _ in items_until(next_item, asyncio.Event()):
                pass

        consumer = asyncio.ensure_future(consume())
        await started.wait()
        consumer.cancel()  # the client went away: grpc.aio cancels the handler
        await asyncio.gather(consumer, return_exceptions=True)
        ended.set()
        for _ in range(3):
            await asyncio.sleep(0)

    errors = run_collecting_loop_errors(main)
    assert [e.get("message") for e in errors] == []
