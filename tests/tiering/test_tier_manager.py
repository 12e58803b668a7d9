"""T0 ↔ T1: offload by policy, promotion of hits, cost-aware skipping, failures as misses."""

from __future__ import annotations

import pytest
import torch

from kvtierd.index.query_counting import QueryCounting
from kvtierd.launch.daemon_process import wait_until
from kvtierd.movers.copy_engine import Direction
from kvtierd.tier import TierCounts
from kvtierd.tiering.load_decision import MIN_SAMPLES, Remeasures
from kvtierd.tiering.tier_config import EdgePolicy
from tests.factories import BLOCK_SIZE, NAMESPACE, tokens
from tests.tiering.tier_factories import content_for, make_manager, measure, prefill, promote_exactly

PROMPT = tokens(100, 4 * BLOCK_SIZE)


@pytest.fixture
def manager():
    manager = make_manager()
    yield manager
    manager.close()


def push_out(manager, num_prompts: int = 3) -> None:
    """Run other prompts through the 8-block pool so that PROMPT's blocks are evicted."""
    for i in range(num_prompts):
        manager.drain()  # write-through holds blocks until their copy lands
        prefill(manager, f"other-{i}", tokens(10_000 * (i + 1), 4 * BLOCK_SIZE))
        manager.release(f"other-{i}")
    manager.drain()


def only_in_t1(manager) -> list[bytes]:
    """Run PROMPT once, then push its blocks out of T0 (into T1 under on_evict); its chain."""
    prefill(manager, "a", PROMPT)
    manager.release("a")
    push_out(manager)
    return NAMESPACE.hash_blocks(PROMPT)


def test_evicted_blocks_are_offloaded_and_promoted_back_with_their_bytes(manager):
    chain = only_in_t1(manager)
    assert manager.index.lookup(chain) == 0
    assert manager.lookup(chain, PROMPT).t1 == 4
    acquisition = promote_exactly(manager, "b", PROMPT)
    assert (acquisition.num_t0_hit_blocks, acquisition.num_t1_blocks) == (0, 4)
    assert manager.index.lookup(chain, PROMPT) == 4  # promoted blocks are committed in T0
    assert manager.stats().t1.num_hit_blocks == 4
    manager.release("b")


def test_an_uncounted_acquire_promotes_from_t1_without_counting_a_query_or_a_hit(manager):
    """QueryCounting.NOTHING (a caller that acquires to store): the T1 blocks it finds still come back
    with their bytes, but neither the query nor the T1 hits are counted; a counted one is."""
    chain = only_in_t1(manager)
    before, queries_before = manager.stats(), manager.tiers.counters.num_query_blocks
    acquisition = manager.acquire("store", chain, 0, PROMPT, counting=QueryCounting.NOTHING)
    assert acquisition.num_t1_blocks == 4 and acquisition.ticket.wait(10) == 4
    manager.release("store")
    after = manager.stats()
    assert (after.t0.num_hit_blocks, after.t1.num_hit_blocks) == (before.t0.num_hit_blocks, before.t1.num_hit_blocks)
    assert manager.tiers.counters.num_query_blocks == queries_before
    counted = manager.acquire("load", chain, 0, PROMPT)
    assert counted.num_t0_hit_blocks == 4  # promoted and committed by the uncounted one
    manager.release("load")
    assert manager.stats().t0.num_hit_blocks == before.t0.num_hit_blocks + 4


def test_a_t1_load_that_lands_before_acquire_returns_still_resolves_the_ticket(manager, monkeypatch):
    """The load may finish on the finalizer thread before the acquiring thread moves on; the
    ticket must resolve anyway (it once waited forever, and SIGTERM then hung on the release)."""
    chain = only_in_t1(manager)
    promoter = manager.promoter
    load = promoter._load

    def load_and_land(level, targets, segment, done):  # on a mover thread
        load(level, targets, segment, done)
        assert wait_until(lambda: segment.num_loaded is not None)  # the copy and its finalizer have run

    monkeypatch.setattr(promoter, "_load", load_and_land)
    acquisition = manager.acquire("b", chain, 0, PROMPT)
    assert acquisition.num_t1_blocks == 4
    assert acquisition.ticket.wait(10) == 4
    manager.release("b")


def test_write_through_copies_committed_blocks_at_once():
    manager = make_manager(t0_to_t1=EdgePolicy.WRITE_THROUGH)
    try:
        prefill(manager, "a", PROMPT)
        manager.drain()
        chain = NAMESPACE.hash_blocks(PROMPT)
        assert manager.tiers.host.index.lookup(chain) == 4  # while still in T0 (inclusive)
        assert manager.stats().num_offloaded_blocks["t0_t1"] == 4
        slots = {e.block_hash: e.slot for e in manager.tiers.host.index.entries()}
        for block_hash in chain:
            row = manager.tiers.host.slots[slots[block_hash]]
            assert torch.equal(row.view(torch.float16).view(content_for(block_hash).shape), content_for(block_hash))
        manager.release("a")
        push_out(manager)
        assert manager.stats().num_offloaded_blocks["t0_t1"] == 4 + 12  # evictions cost no copy
    finally:
        manager.close()


def test_off_policy_moves_nothing():
    manager = make_manager(t0_to_t1=EdgePolicy.OFF)
    try:
        prefill(manager, "a", PROMPT)
        manager.release("a")
        push_out(manager)
        assert manager.lookup(NAMESPACE.hash_blocks(PROMPT)).t1 == 0
        assert manager.stats().t1.used_bytes == 0
    finally:
        manager.close()


def test_a_tier_slower_than_recompute_is_skipped(manager):
    chain = only_in_t1(manager)
    measure(manager.tiers.engine.bandwidth[Direction.HOST_TO_DEVICE], 1 << 20)  # measured: 1 MiB/s
    slow = manager.acquire("b", chain, 0, PROMPT, recompute_s_per_token=1e-15)
    assert slow.num_t1_blocks == 0 and slow.ticket.wait(1) == 0
    assert manager.stats().num_skipped_slow_blocks.t1 == 4
    manager.release("b")
    fast = manager.acquire("c", chain, 0, PROMPT, recompute_s_per_token=1.0)
    assert fast.num_t1_blocks == 4 and fast.ticket.wait(10) == 4
    manager.release("c")


def test_a_declined_host_tier_is_loaded_anyway_once_due_and_that_load_measures_it(manager):
    """With T1 declined nothing uploads, so nothing would measure host -> device again: once an
    interval the declined hit is loaded, and the copy is a sample."""
    chain = only_in_t1(manager)
    h2d = manager.tiers.engine.bandwidth[Direction.HOST_TO_DEVICE]
    measure(h2d, 1 << 20)
    manager.promoter.remeasures = Remeasures(interval_s=0.0)
    probed = manager.acquire("b", chain, 0, PROMPT, recompute_s_per_token=1e-15)
    assert probed.num_t1_blocks == 4 and probed.ticket.wait(10) == 4
    assert h2d.num_samples == MIN_SAMPLES + 1 and manager.stats().num_skipped_slow_blocks.t1 == 0
    manager.release("b")


def test_a_failed_load_is_a_miss_and_leaves_the_blocks_writable(manager, monkeypatch):
    chain = only_in_t1(manager)

    def broken_decode(*args):
        raise RuntimeError("DMA error")

    monkeypatch.setattr(manager.tiers.host.codec, "decode", broken_decode)
    acquisition = manager.acquire("b", chain, 0, PROMPT)
    assert acquisition.num_t1_blocks == 4 and acquisition.ticket.wait(10) == 0
    assert manager.index.lookup(chain) == 0  # nothing committed from a failed load
    assert manager.stats().num_failed_load_blocks == 4
    assert manager.index.prepare_write("b", 0).copied_from is None  # the runner recomputes in place
    assert manager.tiers.host.index.lookup(chain) == 4  # T1 still holds them, unpinned
    manager.release("b")


def test_a_failed_offload_leaves_no_entry(manager, monkeypatch):
    def broken_encode(*args):
        raise RuntimeError("DMA error")

    monkeypatch.setattr(manager.tiers.host.codec, "encode", broken_encode)
    prefill(manager, "a", PROMPT)
    manager.release("a")
    push_out(manager)
    assert manager.tiers.host.index.entries() == []
    assert manager.stats().num_failed_offload_blocks > 0


def test_release_waits_for_a_promotion_in_flight(manager):
    prefill(manager, "a", PROMPT)
    manager.release("a")
    push_out(manager)
    acquisition = manager.acquire("b", NAMESPACE.hash_blocks(PROMPT), 0, PROMPT)
    manager.release("b")
    assert acquisition.ticket.done()
    assert manager.index.num_free_blocks == 8


def test_fp8_host_tier_halves_the_bytes_and_bounds_the_error():
    manager = make_manager(host_codec="fp8")
    try:
        assert manager.tiers.host.codec.slot_nbytes < manager.tiers.layout.bytes_per_block * 0.6
        prefill(manager, "a", PROMPT)
        manager.release("a")
        push_out(manager)
        chain = NAMESPACE.hash_blocks(PROMPT)
        acquisition = manager.acquire("b", chain, 0, PROMPT)
        assert acquisition.ticket.wait(10) == 4
        for block_id, block_hash in zip(acquisition.block_ids, chain):
            expected = content_for(block_hash).float()
            error = (manager.device_pool.tensor[block_id].float() - expected).abs()
            assert float(error.max()) <= float(expected.abs().max()) * 2**-4  # e4m3: 3 mantissa bits
        manager.release("b")
    finally:
        manager.close()


def test_a_layout_of_opaque_pages_keeps_raw_bytes_in_t1_under_an_fp8_config():
    """uint8 pages (linear-attention state, MLA latents) are never quantized: with host_codec fp8
    configured, such a layout's T1 stores raw bytes and every byte comes back, NaN patterns too."""
    from kvtierd.block_hash import Namespace
    from kvtierd.tiering.tier_config import TierConfig
    from kvtierd.tiering.tier_manager import TierManager
    from tests.factories import small_layout

    layout = small_layout(BLOCK_SIZE, model_id="opaque", num_kv_heads=1, head_dim=16, dtype="uint8")
    namespace = Namespace(layout, "")
    manager = TierManager(layout, 4, TierConfig(host_capacity_bytes=32 * 4096, host_codec="fp8",
                                                t0_to_t1=EdgePolicy.WRITE_THROUGH), device="shm", root=namespace.root)
    try:
        codec = manager.tiers.host.codec
        assert codec.name == "raw" and codec.slot_nbytes == layout.bytes_per_block
        prompt = tokens(7, 3 * BLOCK_SIZE)
        chain = namespace.hash_blocks(prompt)
        pages = torch.randint(0, 256, (3, *layout.block_shape), dtype=torch.uint8,
                              generator=torch.Generator().manual_seed(3))
        pages[0].view(-1)[:2] = torch.tensor([0x7F, 0xFF], dtype=torch.uint8)  # a bf16 NaN pattern at the start
        acquired = manager.acquire("a", chain, 0, prompt)
        manager.device_pool.tensor[acquired.block_ids] = pages
        manager.commit("a", 0, chain, prompt, namespace.root)
        manager.release("a")
        manager.drain()
        for i in range(2):  # other prompts push the chain out of the 4-block pool
            other = tokens(1000 * (i + 1), 3 * BLOCK_SIZE)
            manager.acquire(f"o{i}", namespace.hash_blocks(other), 0, other)
            manager.release(f"o{i}")
        again = manager.acquire("b", chain, 0, prompt)
        assert again.num_t0_hit_blocks < 3 and again.ticket.wait(10) == 3
        assert torch.equal(manager.device_pool.tensor[again.block_ids], pages)
        manager.release("b")
    finally:
        manager.close()


def test_a_promotion_keeps_its_t1_hits_while_t0_makes_room_into_a_full_t1():
    """T1 (4 slots) holds only PROMPT's 4 blocks, T0 (8) two other cached prompts: acquiring PROMPT
    evicts one of them from T0 into T1, whose room must not come from PROMPT's own blocks (claimed
    before T0 allocates): all 4 come back exactly and stay in T0."""
    manager = make_manager(num_device_blocks=8, host_blocks=4)
    try:
        prefill(manager, "a", PROMPT)
        manager.release("a")
        push_out(manager, num_prompts=2)  # T0: the two others; T1: PROMPT's blocks, evicted by the second
        chain = NAMESPACE.hash_blocks(PROMPT)
        assert manager.lookup(chain, PROMPT) == TierCounts(t0=0, t1=4)
        acquisition = promote_exactly(manager, "b", PROMPT)
        assert (acquisition.num_t0_hit_blocks, acquisition.num_t1_blocks) == (0, 4)
        manager.release("b")
        manager.drain()
        assert manager.lookup(chain, PROMPT).t0 == 4
    finally:
        manager.close()


def test_lookup_chains_answers_each_chain_counts_the_first_as_the_query_and_holds_its_promise(manager):
    """One core call for a whole Lookup: a chain in T1, a chain half in T0, a chain nowhere, each
    answered on its own; the first chain's leading blocks count as one query (hits by tier); its
    promised T1 blocks are held under the hold's key until released."""
    in_t1 = only_in_t1(manager)  # PROMPT's 4 blocks, in T1 only
    half = tokens(500, 4 * BLOCK_SIZE)
    prefill(manager, "half", half[:2 * BLOCK_SIZE])  # its first 2 blocks in T0, held by "half"
    nowhere = tokens(900, 2 * BLOCK_SIZE)
    chains = [(in_t1, None), (NAMESPACE.hash_blocks(half), None), (NAMESPACE.hash_blocks(nowhere), None)]
    queries_before = manager.tiers.counters.num_query_blocks

    answer = manager.lookup_chains(chains, num_query_blocks=3, hold=(b"tenant", "h1"))

    assert answer.hits == (TierCounts(t1=4), TierCounts(t0=2), TierCounts())
    assert answer.declined == (TierCounts(),) * 3 and answer.num_declined_blocks == 0
    assert answer.total == TierCounts(t0=2, t1=4)
    assert manager.tiers.counters.num_query_blocks - queries_before == 3  # the first chain's 3, once
    assert manager.stats().t1.num_hit_blocks == 3
    assert manager.lookup_holds.holds[b"tenant", "h1"].num_t1_blocks == 4
    assert manager.release_promise((b"tenant", "h1"))
    manager.release("half")
