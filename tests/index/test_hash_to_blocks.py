"""Several copies of one hash, as vLLM's prefix cache keeps them: the map alone, then what the block
index and the tiers see of them (hits, eviction hook, events, counts, operator evict, reset)."""

from __future__ import annotations

import pytest

from kvtierd.index.hash_to_blocks import HashToBlocks
from kvtierd.index.index_events import AllBlocksCleared, BlockRemoved, BlockStored
from kvtierd.index.kv_block import BlockState, KVBlock
from kvtierd.token_bytes import pack_token_ids
from tests.factories import BLOCK_SIZE, NAMESPACE, commit_all, hashes, make_index, tokens

H, G = b"h" * 32, b"g" * 32


def copy_of(block_hash: bytes, block_id: int) -> KVBlock:
    return KVBlock(block_id, block_hash=block_hash)


def ids(blocks) -> list[int]:
    return [block.block_id for block in blocks]


# ---------------------------------------------------------------------------- the map

def test_copies_are_kept_oldest_first_and_the_oldest_serves():
    table = HashToBlocks()
    a, b, c = copy_of(H, 1), copy_of(H, 2), copy_of(H, 3)
    assert [table.insert(H, x) for x in (a, b, c)] == [True, False, False]
    assert table.get(H) is a and ids(table.copies(H)) == [1, 2, 3]
    assert len(table) == 1 and table.num_duplicate_blocks == 2


@pytest.mark.parametrize("removed, left", [(1, [2, 3]), (2, [1, 3]), (3, [1, 2])])
def test_removing_a_copy_keeps_the_others_in_order(removed, left):
    table = HashToBlocks()
    blocks = {i: copy_of(H, i) for i in (1, 2, 3)}
    for block in blocks.values():
        table.insert(H, block)
    assert table.remove(blocks[removed]) is False  # other copies remain: the hash stays
    assert ids(table.copies(H)) == left and table.get(H).block_id == left[0]
    table.insert(H, blocks[removed])  # back in as the newest
    assert ids(table.copies(H)) == [*left, removed]


def test_the_last_copy_leaving_removes_the_hash():
    table = HashToBlocks()
    a, b, g = copy_of(H, 1), copy_of(H, 2), copy_of(G, 3)
    for block_hash, block in ((H, a), (H, b), (G, g)):
        table.insert(block_hash, block)
    assert ids(table.remove_many([a, g, b])) == [3, 2]  # b was the last copy of H, g of G
    assert len(table) == 0 and table.num_duplicate_blocks == 0 and table.copies(H) == []
    assert table.get(H) is None and H not in table


def test_remove_many_without_copies_removes_every_hash():
    table = HashToBlocks()
    a, g = copy_of(H, 1), copy_of(G, 2)
    table.insert(H, a)
    table.insert(G, g)
    assert table.remove_many([a, g]) == [a, g] and len(table) == 0


# ---------------------------------------------------------------------------- in the block index

PROMPT = tokens(100, 2 * BLOCK_SIZE)  # two full blocks


def prefill_one_short(index, request_id, prompt):
    """A vLLM-like prefill: look up one token short, compute the rest, commit every full block."""
    chain = hashes(prompt)
    num_lookup = (len(prompt) - 1) // BLOCK_SIZE
    allocation = index.allocate(request_id, chain[:num_lookup], -(-len(prompt) // BLOCK_SIZE) - num_lookup, prompt)
    start = allocation.num_hit_blocks
    parent = chain[start - 1] if start else NAMESPACE.root
    index.commit_blocks(request_id, start, chain[start:], prompt[start * BLOCK_SIZE:len(chain) * BLOCK_SIZE], parent)
    return allocation


def test_a_second_writer_of_a_hash_commits_a_second_copy_that_queues_behind_the_first():
    index = make_index(max_pending_events=100)
    chain = hashes(PROMPT)
    index.allocate("a", chain)
    index.allocate("b", chain)  # both missed: two writers of the same content
    assert index.commit("a", 0, chain[0], PROMPT[:BLOCK_SIZE], NAMESPACE.root) is True
    assert index.commit("b", 0, chain[0], PROMPT[:BLOCK_SIZE], NAMESPACE.root) is True
    a0, b0 = index.block_table("a")[0], index.block_table("b")[0]
    assert ids(index.hash_to_blocks.copies(chain[0])) == [a0, b0] and index.hash_to_block[chain[0]].block_id == a0
    assert index.blocks[b0].state is BlockState.IN_USE_SHAREABLE
    assert index.num_cached_blocks == 1 and index.num_duplicate_blocks == 1 and index.cached_hashes() == [chain[0]]
    assert index.take_events() == [BlockStored(chain[0], NAMESPACE.root, a0, pack_token_ids(PROMPT[:BLOCK_SIZE]))]
    index.free("a")
    index.free("b")
    assert index.allocate("c", chain[:1]).block_ids == [a0]  # a hit takes the oldest copy


def test_when_the_older_copy_is_evicted_the_newer_serves_and_only_the_last_copy_reaches_the_hook():
    """The seeds' four requests on a 4-block pool: D hits both blocks (as vLLM does)."""
    evicted: list[tuple[int, bytes]] = []
    index = make_index(4, on_evict=lambda blocks: evicted.extend((b.block_id, b.block_hash) for b in blocks),
                       max_pending_events=100)
    chain = hashes(PROMPT)
    hits = []
    for request_id, prompt in (("A", PROMPT), ("B", PROMPT), ("C", tokens(900, 2 * BLOCK_SIZE))):
        hits.append(prefill_one_short(index, request_id, prompt).num_hit_blocks)
        index.free(request_id)
    assert hits == [0, 1, 0]  # B recomputed block 1: a second copy of chain[1]
    assert index.num_cached_blocks == 4 and index.num_duplicate_blocks == 0  # C evicted A's copy of chain[1]
    assert evicted == [] and BlockRemoved(chain[1]) not in index.take_events()  # chain[1] never left T0
    assert prefill_one_short(index, "D", PROMPT + tokens(500, BLOCK_SIZE)).num_hit_blocks == 2
    index.free("D")
    index.take_events()
    held_copy = index.hash_to_block[chain[1]]
    assert prefill_one_short(index, "E", tokens(700, 4 * BLOCK_SIZE)).num_hit_blocks == 0  # evicts everything
    assert (held_copy.block_id, chain[1]) in evicted  # the last copy reached the hook, once
    assert sum(h == chain[1] for _, h in evicted) == 1
    assert index.take_events().count(BlockRemoved(chain[1])) == 1


def test_operator_evict_drops_every_copy_nobody_holds_and_counts_hashes():
    index = make_index(6, max_pending_events=100)
    chain = hashes(PROMPT)
    for request_id in ("a", "b", "c"):
        index.allocate(request_id, chain)  # all miss: three writers of the same content
    for request_id in ("a", "b", "c"):
        commit_all(index, request_id, PROMPT)  # three copies of each hash
    assert index.num_cached_blocks == 2 and index.num_duplicate_blocks == 4
    index.free("a")
    index.free("b")
    index.take_events()
    assert index.evict(chain) == 0  # c still holds a copy of both: no hash left T0
    assert ids(index.hash_to_blocks.copies(chain[0])) == [index.block_table("c")[0]]
    assert index.take_events() == [] and index.num_duplicate_blocks == 0
    index.free("c")
    assert index.evict([chain[0], chain[0]]) == 1 and index.take_events() == [BlockRemoved(chain[0])]
    assert index.lookup(chain) == 0 and index.num_cached_blocks == 1


def test_reset_forgets_every_copy():
    index = make_index(max_pending_events=100)
    for request_id in ("a", "b"):
        index.allocate(request_id, hashes(PROMPT))
    for request_id in ("a", "b"):
        commit_all(index, request_id, PROMPT)
    assert index.num_duplicate_blocks == 2
    index.free("a")
    index.free("b")
    index.take_events()
    assert index.reset() is True
    assert {block.state for block in index.blocks} == {BlockState.EMPTY}
    assert index.num_cached_blocks == 0 and index.num_duplicate_blocks == 0
    assert index.take_events() == [AllBlocksCleared()]


def test_freed_blocks_without_a_hash_are_reused_before_cached_ones():
    """As vLLM's BlockPool.free_blocks: blocks holding nothing go to the head, cached to the tail."""
    index = make_index(6)
    prompt = PROMPT + tokens(800, 1)  # two full blocks and a partial one that gets no hash
    index.allocate("a", hashes(prompt), num_extra_blocks=1)
    commit_all(index, "a", prompt)
    index.free("a")
    assert [block.block_id for block in index.free_queue] == [2, 3, 4, 5, 1, 0]
    assert index.allocate("b", [], num_extra_blocks=1).block_ids == [2]
    assert index.lookup(hashes(PROMPT)) == 2
