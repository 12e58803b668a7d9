"""CopyEngines: one engine per device, shared by its users and closed after the last one."""

from __future__ import annotations

import pytest

from kvtierd.movers.copy_engine import Direction, ThreadCopyEngine
from kvtierd.movers.factory import CopyEngines


def test_users_of_one_device_share_its_engine_and_its_budget():
    engines = CopyEngines(num_cpu_threads=1)
    first, second = engines.acquire("cpu"), engines.acquire("cpu")
    assert first is second and isinstance(first, ThreadCopyEngine) and engines.num_users("cpu") == 2
    moved = []
    first.run(Direction.HOST_TO_HOST, lambda: moved.append("a"), 10)
    second.run(Direction.HOST_TO_HOST, lambda: moved.append("b"), 20)
    assert moved == ["a", "b"] and first.bandwidth[Direction.HOST_TO_HOST].total_bytes == 30  # one estimate
    engines.release(first)
    assert not second.closed and engines.num_users("cpu") == 1
    engines.release(second)
    assert second.closed and engines.num_users("cpu") == 0


def test_an_acquire_after_the_last_release_gets_a_fresh_engine():
    engines = CopyEngines()
    old = engines.acquire("cpu")
    engines.release(old)
    new = engines.acquire("cpu")
    assert new is not old and old.closed and not new.closed
    engines.release(new)


def test_releasing_an_engine_from_elsewhere_is_a_bug():
    engines = CopyEngines()
    stranger = ThreadCopyEngine(num_threads=1)
    with pytest.raises(AssertionError):
        engines.release(stranger)
    stranger.close()
