"""Residency bookkeeping: one bucket and sum per block and reason, percentiles interpolated as
Prometheus does, and the index's own records (T0 from commit, a slot index from its store)."""

from __future__ import annotations

import math

from kvtierd.daemon_key import DaemonKey
from kvtierd.index.residency import RESIDENCY_BUCKETS_S, LeaveReason, Residency
from kvtierd.index.slot_entry import BlockMeta
from kvtierd.index.slot_index import SlotIndex
from kvtierd.token_bytes import NO_TOKENS

KEY = DaemonKey(bytes(48))


def test_each_block_counts_once_in_its_bucket_and_reason():
    """0.1 s lands in the first bucket (le), 0.11 s in the second, a week in +Inf; sums per reason."""
    residency = Residency()
    residency.classify = lambda key, resident_s: LeaveReason.DEMOTED if resident_s > 1 else LeaveReason.EVICTED
    for resident_s in (0.1, 0.11, 7 * 86400.0):
        residency.left(KEY, resident_s)
    residency.left(KEY, 3.0, LeaveReason.FLUSHED)
    snapshot = residency.snapshot()
    evicted, demoted = snapshot.by_reason[LeaveReason.EVICTED], snapshot.by_reason[LeaveReason.DEMOTED]
    assert evicted.bucket_counts[:2] == (1, 1) and evicted.num_blocks == 2
    assert math.isclose(evicted.sum_s, 0.21)
    assert demoted.bucket_counts[len(RESIDENCY_BUCKETS_S)] == 1 and demoted.num_blocks == 1
    assert snapshot.by_reason[LeaveReason.FLUSHED].num_blocks == 1
    assert snapshot.by_reason[LeaveReason.EXPIRED].num_blocks == 0 and snapshot.num_blocks == 4


def test_percentiles_interpolate_within_buckets():
    """Ten blocks of 2 s (bucket 1..2.5 s) and ten of 20 s (10..30 s): p50 at the first bucket's top,
    p90 four fifths into the second; nothing left: nan."""
    residency = Residency()
    assert math.isnan(residency.snapshot().percentile_s(50))
    for _ in range(10):
        residency.left(KEY, 2.0)
        residency.left(KEY, 20.0)
    snapshot = residency.snapshot()
    assert snapshot.percentile_s(50) == 2.5
    assert math.isclose(snapshot.percentile_s(90), 10 + 20 * 0.8)


def test_a_slot_index_records_residency_from_the_store_by_reason():
    """Stored at t=0, evicted for room at t=5 (classified), removed by an operator at t=7 (flushed)."""
    now = [0.0]
    index = SlotIndex(1, clock=lambda: now[0])
    index.residency.classify = lambda key, resident_s: LeaveReason.DEMOTED
    first, second = (BlockMeta(DaemonKey(bytes([i]) * 48), DaemonKey(bytes(48)), NO_TOKENS) for i in (1, 2))
    index.complete_store(index.prepare_store([first]).stores, success=True)
    now[0] = 5.0
    index.complete_store(index.prepare_store([second]).stores, success=True)  # evicts the first
    now[0] = 7.0
    index.remove([second.block_hash])
    by_reason = index.residency.snapshot().by_reason
    assert (by_reason[LeaveReason.DEMOTED].num_blocks, by_reason[LeaveReason.DEMOTED].sum_s) == (1, 5.0)
    assert (by_reason[LeaveReason.FLUSHED].num_blocks, by_reason[LeaveReason.FLUSHED].sum_s) == (1, 2.0)
