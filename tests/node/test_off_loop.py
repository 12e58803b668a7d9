"""call_blocking_if: a call that may wait on the network runs on a thread, any other on the loop;
a caller cancelled while the thread runs has what the call took given back once it returns."""

from __future__ import annotations

import asyncio
import threading

import pytest

from kvtierd.node.off_loop import call_blocking_if


def test_a_call_that_does_not_block_runs_on_the_loop_thread():
    async def main():
        return await call_blocking_if(False, threading.get_ident), threading.get_ident()

    ran_on, loop_thread = asyncio.run(main())
    assert ran_on == loop_thread


def test_a_call_that_may_block_runs_on_another_thread():
    async def main():
        return await call_blocking_if(True, threading.get_ident), threading.get_ident()

    ran_on, loop_thread = asyncio.run(main())
    assert ran_on != loop_thread


def test_a_cancelled_caller_has_what_the_call_took_given_back_once_it_returns():
    """The result of a call whose caller was cancelled meanwhile reaches `undo`, and only after it returned."""
    release, entered = threading.Event(), threading.Event()
    given_back: list[str] = []
    undone = threading.Event()

    def work() -> str:
        entered.set()
        assert release.wait(10)
        return "blocks"

    def undo(result: str) -> None:
        given_back.append(result)
        undone.set()

    async def main() -> None:
        task = asyncio.create_task(call_blocking_if(True, work, undo))
        await asyncio.to_thread(entered.wait, 10)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert given_back == []  # the call still runs
        release.set()
        assert await asyncio.to_thread(undone.wait, 10)

    asyncio.run(main())
    assert given_back == ["blocks"]


def test_a_call_that_raises_has_nothing_to_give_back():
    undone: list[object] = []

    def work() -> None:
        raise ValueError("refused")

    async def main() -> None:
        with pytest.raises(ValueError, match="refused"):
            await call_blocking_if(True, work, undone.append)

    asyncio.run(main())
    assert undone == []
