"""retention.max_age_s in the SSD tier: a block stored longer ago than the limit is never loaded and
is reclaimed, by the load that meets it or by the sweep; the time of a store survives a restart."""

from __future__ import annotations

import dataclasses
import struct
import time

import pytest
import torch

from kvtierd.errors import InvalidArgument
from kvtierd.retention.retention_config import RetentionConfig
from kvtierd.t2.ssd_index import Record, SsdIndex
from kvtierd.t2.ssd_tier import SsdTier, SsdTierConfig
from tests.factories import small_layout
from tests.t2.test_ssd_tier import chain, hashes

LAYOUT = small_layout()
HOUR_S = 3600.0


def open_tier(tmp_path, max_age_s: float) -> SsdTier:
    config = SsdTierConfig([str(tmp_path / "t2")], capacity_bytes=32 * 4096, lmdb_map_bytes=16 << 20,
                           max_age_s=max_age_s)
    return SsdTier.open(config, LAYOUT)


def num_loaded(tier: SsdTier, keys: list[bytes]) -> int:
    return tier.load(keys, torch.zeros(len(keys), LAYOUT.bytes_per_block, dtype=torch.uint8))


def stored_six_with_the_last_three_two_hours_old(tmp_path) -> list[bytes]:
    """Six chained blocks stored now; then the index records of 3, 4, 5 rewritten as stored two hours ago."""
    items = chain(6)
    tier = open_tier(tmp_path, HOUR_S)
    assert tier.store(items) == 6
    tier.close()
    index = SsdIndex(str(tmp_path / "t2"), 16 << 20, durable=True)
    records, _ = index.scan(lambda record: True)
    old = {key for key in hashes(items)[3:]}
    index.commit([], [dataclasses.replace(r, stored_s=time.time() - 2 * HOUR_S) for r in records
                      if r.block_hash in old], None)
    index.close()
    return hashes(items)


def test_a_load_stops_at_a_block_past_the_limit_and_drops_the_aged_ones(tmp_path):
    """The prefix ends at block 3 (stored two hours ago, limit one hour); 3-5 are dropped and counted;
    a restart finds 0-2 only, still within the limit."""
    keys = stored_six_with_the_last_three_two_hours_old(tmp_path)
    tier = open_tier(tmp_path, HOUR_S)
    try:
        assert tier.stats().num_recovered_blocks == 6  # the store time came back from the index
        assert num_loaded(tier, keys) == 3
        assert [tier.holds(key) for key in keys] == [True] * 3 + [False] * 3
        assert tier.stats().num_aged_out_blocks == 3
    finally:
        tier.close()
    tier = open_tier(tmp_path, HOUR_S)
    try:
        assert tier.stats().num_recovered_blocks == 3 and num_loaded(tier, keys) == 3
    finally:
        tier.close()


def test_the_sweep_reclaims_aged_blocks_nobody_asked_for_and_paces_itself(tmp_path):
    """expire_aged drops 3-5 without a load; called again at once, the next scan is not due yet."""
    keys = stored_six_with_the_last_three_two_hours_old(tmp_path)
    tier = open_tier(tmp_path, HOUR_S)
    try:
        assert tier.drops.expire_aged() == 3
        assert sorted(tier.block_hashes()) == sorted(keys[:3])
        assert tier.stats().used_bytes == 3 * tier.stride  # their slots are free
        assert tier.drops.expire_aged() == 0
    finally:
        tier.close()


def test_without_a_limit_old_blocks_are_served(tmp_path):
    """The control: the same two-hour-old blocks, no limit: all six load and the sweep drops nothing."""
    keys = stored_six_with_the_last_three_two_hours_old(tmp_path)
    tier = open_tier(tmp_path, 0.0)
    try:
        assert tier.drops.expire_aged() == 0 and num_loaded(tier, keys) == 6
    finally:
        tier.close()


def test_a_version_1_record_counts_its_age_from_its_last_use():
    """Records written before the store time was kept read it as their last use."""
    record = Record(b"k" * 48, 0, 3, 512, 7, 9, 1234.5, b"p" * 48, b"tokens", stored_s=99.0)
    encoded = record.encode()
    head = struct.Struct("<BHIIQQdB")
    version_1 = bytes([1]) + encoded[1:head.size] + encoded[head.size + 8:]
    assert Record.decode(record.block_hash, encoded) == record
    assert Record.decode(record.block_hash, version_1) == dataclasses.replace(record, stored_s=1234.5)


@pytest.mark.parametrize("max_age_s", [-1.0, float("inf"), float("nan")])
def test_a_negative_or_infinite_limit_is_refused(max_age_s):
    with pytest.raises(InvalidArgument, match="retention.max_age_s"):
        RetentionConfig(max_age_s=max_age_s)
