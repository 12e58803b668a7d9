"""Each tier's eviction order for blocks without a live hint (set_eviction): under S3-FIFO a block
read twice outlasts a flood of one-off blocks that LRU lets evict it, in T0's free queue and in a
lower tier's slot index; blocks that hold nothing still go first, and hints still outrank it."""

from __future__ import annotations

import pytest

from kvtierd.index.slot_entry import BlockMeta
from kvtierd.index.slot_index import SlotIndex
from kvtierd.retention.hint import Priority
from kvtierd.retention.hint_table import HintTable
from kvtierd.retention.tier_retention import TierRetention
from kvtierd.tier import Tier
from kvtierd.token_bytes import NO_TOKENS
from tests.factories import BLOCK_SIZE, FakeClock, hashes, make_index, run_request, tokens

NUM_BLOCKS = 10
SURVIVES = {"lru": False, "s3fifo": True}


def t0_index(eviction: str):
    index = make_index(NUM_BLOCKS)
    index.set_eviction(eviction)
    return index


def read(index, request_id: str, token_ids: list[int]) -> int:
    """One request over `token_ids` (committed), released at once; returns its number of hits."""
    allocation = run_request(index, request_id, token_ids)
    index.free(request_id)
    return allocation.num_hit_blocks


def flood_t0(index, num_chains: int) -> None:
    for i in range(num_chains):
        read(index, f"flood{i}", tokens(10_000 * (i + 1), BLOCK_SIZE))


@pytest.mark.parametrize("eviction", ["lru", "s3fifo"])
def test_t0_keeps_a_block_read_twice_through_a_flood_only_under_s3fifo(eviction):
    index = t0_index(eviction)
    hot = tokens(0, BLOCK_SIZE)
    assert [read(index, f"hot{i}", hot) for i in range(3)] == [0, 1, 1]  # stored, then hit twice
    flood_t0(index, 3 * NUM_BLOCKS)
    assert (index.lookup(hashes(hot)) == 1) is SURVIVES[eviction]


@pytest.mark.parametrize("eviction", ["lru", "s3fifo"])
def test_t0_reuses_blocks_that_hold_nothing_before_any_cached_block(eviction):
    index = t0_index(eviction)
    cached = tokens(0, 4 * BLOCK_SIZE)
    read(index, "cached", cached)
    index.allocate("scratch", [], 3)  # written, never committed: no hash
    index.free("scratch")
    evicted: list[bytes | None] = []
    index.on_evict = lambda blocks: evicted.extend(block.block_hash for block in blocks)
    index.allocate("fresh", [], NUM_BLOCKS - 4)  # the 6 empty blocks are enough
    assert evicted == [] and index.lookup(hashes(cached)) == 4
    index.allocate("more", [], 1)
    assert len(evicted) == 1


def test_t0_under_s3fifo_still_evicts_unretained_blocks_before_retained_ones():
    clock = FakeClock()
    table = HintTable(clock)
    index = make_index(4, clock=clock)
    index.set_eviction("s3fifo")
    index.set_retention(TierRetention(Tier.T0, table, lambda: 1000))
    table.add_listener(index.reclassify)
    chains = [tokens(1000 * (i + 1), BLOCK_SIZE) for i in range(4)]
    for i, chain in enumerate(chains):
        read(index, f"r{i}", chain)
    read(index, "again", chains[1])  # a hit: chain 1 goes to S3-FIFO's main
    table.set(hashes(chains[0]), "s", Priority.LOW, 60)
    order = [block.block_hash for block in index.free_queue]
    assert order == [*hashes(chains[2]), *hashes(chains[3]), *hashes(chains[1]), *hashes(chains[0])]
    clock.advance(61)  # the hint lapses: its block is the next victim
    assert table.expire() == 1
    assert [block.block_hash for block in index.free_queue][0] == hashes(chains[0])[0]


def t1_index(eviction: str, num_slots: int = NUM_BLOCKS) -> SlotIndex:
    index = SlotIndex(num_slots, FakeClock())
    index.set_eviction(eviction)
    return index


def store(index: SlotIndex, key: bytes) -> None:
    plan = index.prepare_store([BlockMeta(key, b"\x00" * 32, NO_TOKENS)])
    index.complete_store(plan.stores, success=True)


def load(index: SlotIndex, key: bytes) -> None:
    pinned = index.prepare_load([key])
    assert len(pinned) == 1
    index.unpin(pinned)


def flood_t1(index: SlotIndex, num_keys: int) -> None:
    for i in range(num_keys):
        store(index, (1000 + i).to_bytes(32, "big"))


HOT = b"\x01" * 32


@pytest.mark.parametrize("eviction", ["lru", "s3fifo"])
def test_a_slot_index_keeps_an_entry_loaded_twice_through_a_flood_only_under_s3fifo(eviction):
    index = t1_index(eviction)
    store(index, HOT)
    load(index, HOT)
    load(index, HOT)
    flood_t1(index, 3 * NUM_BLOCKS)
    assert (HOT in index) is SURVIVES[eviction]


def test_a_slot_index_forgets_the_loads_of_an_entry_that_left():
    """An entry loaded, removed and stored again is new: S3-FIFO lets a flood evict it."""
    index = t1_index("s3fifo")
    store(index, HOT)
    load(index, HOT)
    assert [entry.block_hash for entry in index.remove([HOT])] == [HOT]
    store(index, HOT)
    flood_t1(index, 3 * NUM_BLOCKS)
    assert HOT not in index


def test_switching_a_slot_index_to_s3fifo_keeps_its_entries_in_victim_order():
    """Restored entries (T2 at open) move over, oldest first, as new keys."""
    index = SlotIndex(4, FakeClock())
    metas = [BlockMeta(bytes([i]) * 32, b"\x00" * 32, NO_TOKENS) for i in range(4)]
    index.restore([(meta, slot, float(10 - slot)) for slot, meta in enumerate(metas)])
    index.set_eviction("s3fifo")
    evicted = index.evict_lru(4)
    assert [entry.block_hash for entry in evicted] == [meta.block_hash for meta in reversed(metas)]


def test_an_unknown_eviction_name_is_refused():
    with pytest.raises(ValueError, match="one of lru, s3fifo"):
        t1_index("arc")
