"""The HyperLogLog of distinct keys: within 2 % at 100k, adding a key again changes nothing, and the
unbounded cache's hit blocks on runs whose answer is known."""

from __future__ import annotations

import hashlib

import pytest

from kvtierd.index.distinct_keys import DistinctKeys, unbounded_hit_blocks


def keys(start: int, stop: int) -> list[bytes]:
    return [bytes(16) + hashlib.sha256(i.to_bytes(8, "little")).digest() for i in range(start, stop)]


@pytest.mark.parametrize("num_keys", [1000, 100_000])
def test_the_estimate_is_within_2_percent(num_keys):
    """Each key added twice: the estimate is of distinct keys, within 2 % (0.8 % standard error)."""
    distinct = DistinctKeys()
    for key in keys(0, num_keys) * 2:
        distinct.add(key)
    assert abs(distinct.estimate() - num_keys) <= 0.02 * num_keys


def test_empty_is_zero():
    assert DistinctKeys().estimate() == 0


def test_unbounded_hits_are_all_but_first_sights():
    """A chain of 10 asked 5 times: 50 query blocks, 10 first sights: 40 hits; never below the real
    hits (blocks another node stored), never above the queries, never negative."""
    assert unbounded_hit_blocks(50, 12, 10) == 40
    assert unbounded_hit_blocks(50, 45, 10) == 45
    assert unbounded_hit_blocks(50, 0, 80) == 0
    assert unbounded_hit_blocks(50, 0, 0) == 50
