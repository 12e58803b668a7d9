"""T1 ↔ T2 through the tier manager: write-through to SSD, promotion from T2 (landing in T1 too),
restart, prefetch, cost-aware skipping, fp8 below a raw host tier, corruption as a miss."""

from __future__ import annotations

import os

import pytest

from kvtierd.t2.ssd_tier import SsdTierConfig
from kvtierd.tiering.tier_config import EdgePolicy
from tests.factories import BLOCK_SIZE, NAMESPACE, tokens
from tests.tiering.tier_factories import assert_holds, content_for, make_manager, measure, prefill, promote_exactly

PROMPT = tokens(100, 4 * BLOCK_SIZE)
CHAIN = NAMESPACE.hash_blocks(PROMPT)


def ssd_config(tmp_path) -> SsdTierConfig:
    return SsdTierConfig([str(tmp_path / "ssd")], capacity_bytes=64 * 4096)


def only_in_t2(manager) -> None:
    """Drop the prompt from T0 and T1 (after write-through has put it in T2)."""
    manager.drain()
    manager.index.evict(CHAIN)
    manager.drain()
    manager.tiers.host.index.remove(CHAIN)
    assert manager.lookup(CHAIN, PROMPT).t2 == 4


@pytest.fixture
def manager(tmp_path):
    manager = make_manager(ssd_config=ssd_config(tmp_path), t0_to_t1=EdgePolicy.WRITE_THROUGH)
    yield manager
    manager.close()


def test_blocks_flow_down_to_t2_and_promote_back_through_t1(manager):
    prefill(manager, "a", PROMPT)
    manager.release("a")
    only_in_t2(manager)
    acquisition = promote_exactly(manager, "b", PROMPT)
    assert (acquisition.num_t0_hit_blocks, acquisition.num_t1_blocks, acquisition.num_t2_blocks) == (0, 0, 4)
    manager.drain()
    assert manager.tiers.host.index.lookup(CHAIN) == 4  # landed in T1 on the way up
    assert manager.index.lookup(CHAIN, PROMPT) == 4
    assert manager.stats().t2.num_hit_blocks == 4
    manager.release("b")


def test_a_restarted_manager_serves_t2_hits(tmp_path):
    first = make_manager(ssd_config=ssd_config(tmp_path), t0_to_t1=EdgePolicy.WRITE_THROUGH)
    prefill(first, "a", PROMPT)
    first.release("a")
    first.close()
    second = make_manager(ssd_config=ssd_config(tmp_path))
    try:
        hits = second.lookup(CHAIN, PROMPT)
        assert (hits.t0, hits.t1, hits.t2) == (0, 0, 4)
        promote_exactly(second, "b", PROMPT)
        second.release("b")
    finally:
        second.close()


def test_prefetch_brings_t2_hits_into_t1(manager):
    prefill(manager, "a", PROMPT)
    manager.release("a")
    only_in_t2(manager)
    assert manager.lookup(CHAIN, PROMPT, prefetch=True).t2 == 4
    manager.drain()
    assert manager.lookup(CHAIN, PROMPT).t1 == 4


def test_a_slow_ssd_is_skipped_when_recompute_is_faster(manager):
    prefill(manager, "a", PROMPT)
    manager.release("a")
    only_in_t2(manager)
    measure(manager.tiers.ssd_read, 1000)  # measured as slow as a failing disk
    acquisition = manager.acquire("b", CHAIN, 0, PROMPT, recompute_s_per_token=1e-3)
    assert acquisition.num_t2_blocks == 0 and acquisition.ticket.wait(1) == 0
    assert manager.stats().num_skipped_slow_blocks.t2 == 4
    manager.release("b")


def test_fp8_on_ssd_below_a_raw_host_tier(tmp_path):
    manager = make_manager(ssd_config=ssd_config(tmp_path), t0_to_t1=EdgePolicy.WRITE_THROUGH, ssd_codec="fp8")
    try:
        prefill(manager, "a", PROMPT)
        manager.release("a")
        only_in_t2(manager)
        assert manager.tiers.ssd.slot_nbytes < manager.tiers.layout.bytes_per_block * 0.6
        acquisition = manager.acquire("b", CHAIN, 0, PROMPT)
        assert acquisition.ticket.wait(10) == 4
        for block_id, block_hash in zip(acquisition.block_ids, CHAIN):
            expected = content_for(block_hash).float()
            error = (manager.device_pool.tensor[block_id].float() - expected).abs()
            assert float(error.max()) <= float(expected.abs().max()) / 16
        manager.release("b")
    finally:
        manager.close()


def test_a_corrupt_ssd_block_is_a_miss_never_wrong_bytes(manager, tmp_path):
    prefill(manager, "a", PROMPT)
    manager.release("a")
    only_in_t2(manager)
    slot_files = [p for p in (tmp_path / "ssd").iterdir() if p.is_file() and p.stat().st_size >= 4096 * 4
                  and "lmdb" not in p.name and not p.name.endswith((".mdb", ".lock"))]
    with open(slot_files[0], "r+b") as f:  # flip one bit in every slot in use
        for slot in range(8):
            f.seek(slot * 4096 + 100)
            byte = f.read(1)
            f.seek(slot * 4096 + 100)
            f.write(bytes([byte[0] ^ 0x10]))
        os.fsync(f.fileno())
    acquisition = manager.acquire("b", CHAIN, 0, PROMPT)
    num_ready = acquisition.ticket.wait(10)
    assert num_ready < 4
    assert_holds(manager, acquisition.block_ids[:num_ready], CHAIN[:num_ready])
    assert manager.stats().ssd.num_corrupted_blocks >= 1
    assert manager.index.lookup(CHAIN) == num_ready  # nothing past the failure is committed
    manager.release("b")


def test_on_evict_from_t1_spills_to_t2(tmp_path):
    manager = make_manager(host_blocks=4, ssd_config=ssd_config(tmp_path), t1_to_t2=EdgePolicy.ON_EVICT)
    try:
        prefill(manager, "a", PROMPT)
        manager.release("a")
        manager.index.evict(CHAIN)  # T0 → T1 (on_evict): the 4 slots are full
        manager.drain()
        assert manager.tiers.ssd.lookup(CHAIN) == 0  # nothing written down yet under on_evict
        other = tokens(7000, 4 * BLOCK_SIZE)
        prefill(manager, "b", other)
        manager.release("b")
        manager.index.evict(NAMESPACE.hash_blocks(other))  # T1 evicts PROMPT's blocks: they go to T2
        manager.drain()
        hits = manager.lookup(CHAIN, PROMPT)
        assert (hits.t1, hits.t2) == (0, 4)
        promote_exactly(manager, "c", PROMPT)
        manager.release("c")
    finally:
        manager.close()


def test_on_evict_spills_to_an_fp8_ssd_below_a_raw_host_tier(tmp_path):
    """T1's victims are converted to T2's codec on the way to the spill thread, and load back within fp8's error."""
    manager = make_manager(host_blocks=4, ssd_config=ssd_config(tmp_path), t1_to_t2=EdgePolicy.ON_EVICT,
                           ssd_codec="fp8")
    try:
        prefill(manager, "a", PROMPT)
        manager.release("a")
        manager.index.evict(CHAIN)
        other = tokens(7000, 4 * BLOCK_SIZE)
        prefill(manager, "b", other)
        manager.release("b")
        manager.index.evict(NAMESPACE.hash_blocks(other))  # T1 evicts PROMPT's blocks: they go to T2
        manager.drain()
        assert manager.stats().num_offloaded_blocks["t1_t2"] == 4
        acquisition = manager.acquire("c", CHAIN, 0, PROMPT)
        assert (acquisition.num_t1_blocks, acquisition.num_t2_blocks) == (0, 4)
        assert acquisition.ticket.wait(10) == 4
        for block_id, block_hash in zip(acquisition.block_ids, CHAIN):
            expected = content_for(block_hash).float()
            error = (manager.device_pool.tensor[block_id].float() - expected).abs()
            assert float(error.max()) <= float(expected.abs().max()) / 16
        manager.release("c")
    finally:
        manager.close()
