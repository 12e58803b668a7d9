"""The one place the daemon decides whether a core call runs on its event loop or on a thread.

A call into the tier manager never waits on a copy or a disk, but with T3 (`TierManager.has_remote`)
a lookup, an acquire or the start of a Get may wait on the shared store: a network round trip,
bounded by the store's timeout and breaker. Such a call runs on the default executor; any other
runs on the loop, at once (a thread hop costs more than the call). A call moved to a thread may
take something (blocks of the pool) that its caller, cancelled meanwhile, never sees: `undo`
gives it back once the call returns.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


async def call_blocking_if(blocking: bool, work: Callable[[], T], undo: Callable[[T], object] | None = None) -> T:
    """`work()`: on the default executor when `blocking` (it may wait on the network), else here.
    When the caller is cancelled while `work` runs on its thread, `undo(result)` gives back what
    it took, on a thread, once it returns (None: it takes nothing)."""
    if not blocking:
        return work()
    loop = asyncio.get_running_loop()
    future = loop.run_in_executor(None, functools.partial(contextvars.copy_context().run, work))
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        if undo is not None:
            def give_back(done: asyncio.Future[T]) -> None:
                if not done.cancelled() and done.exception() is None:
                    loop.run_in_executor(None, undo, done.result())

            future.add_done_callback(give_back)
        raise
