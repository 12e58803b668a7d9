"""The items of a stream (a KeepAlive's pings, an Events subscription) until it ends or the daemon stops."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


async def items_until(next_item: Callable[[], Awaitable[T]], stop: asyncio.Event) -> AsyncIterator[T]:
    """The items `await next_item()` gives, until it raises StopAsyncIteration or `stop` is set.

    Each `next_item()` runs as a task beside `stop.wait()`. A task left behind (stop set, or this
    generator closed because its stream's call was cancelled) is cancelled, and its outcome is
    retrieved when it ends: a stream that then ends with StopAsyncIteration is not an error, and
    asyncio would otherwise log "Task exception was never retrieved" at shutdown.
    """
    while not stop.is_set():
        item = asyncio.ensure_future(next_item())
        item.add_done_callback(_retrieve_outcome)
        stopped = asyncio.ensure_future(stop.wait())
        try:
            done, _ = await asyncio.wait({item, stopped}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopped.cancel()
            if not item.done():
                item.cancel()
        if item not in done:
            return
        try:
            value = item.result()
        except StopAsyncIteration:
            return
        yield value


def _retrieve_outcome(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()
