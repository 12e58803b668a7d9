"""The simulator's engine cache: running requests hold their blocks, finished ones are cached tail
first, new blocks evict the least recently used cached ones."""

from __future__ import annotations

from kvtierd.daemon_key import DaemonKey
from kvtierd.planning.engine_cache import EngineCache


def keys(name: str, count: int) -> list[DaemonKey]:
    return [DaemonKey(f"{name}{i}".encode().ljust(48, b".")) for i in range(count)]


def test_blocks_of_running_requests_are_never_evicted_and_a_finished_tail_leaves_first():
    engine = EngineCache(4)
    a, b = keys("a", 3), keys("b", 1)
    assert engine.start(a) == 0
    assert engine.start(b) == 0  # 6 blocks in use over a capacity of 4: nothing to evict
    assert engine.num_in_use_blocks == 6 and not engine.cached
    engine.finish(a)  # 3 cached + 2 in use > 4: a's tail goes
    assert list(engine.cached) == [a[1], a[0]] and engine.num_in_use_blocks == 2
    engine.finish(b)
    assert list(engine.cached) == [a[1], a[0], b[0]]
    assert engine.start([*a[:2], *keys("c", 1)]) == 2  # a's head is still there
    assert not engine.cached and engine.num_in_use_blocks == 4  # a0, a1, c0 and c's private block: b0 went


def test_a_block_in_use_by_a_running_request_is_a_hit_for_another_and_stays_until_both_finish():
    engine = EngineCache(3)
    shared = keys("s", 2)
    assert engine.start(shared) == 0
    assert engine.start([*shared, *keys("x", 1)]) == 2  # the first request holds them: shared, not copied
    assert engine.num_in_use_blocks == 2 + 1 + 2  # two keys once, one new key, one private block each
    engine.finish(shared)
    assert not engine.cached  # the second request still holds them
    engine.finish([*shared, *keys("x", 1)])
    assert list(engine.cached) == [keys("x", 1)[0], shared[1], shared[0]]
