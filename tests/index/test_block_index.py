"""The block index, one transition at a time (seed 000 §6.3, design §5)."""

from __future__ import annotations

import pytest

from kvtierd.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from kvtierd.index.index_events import AllBlocksCleared, BlockRemoved, BlockStored
from kvtierd.index.kv_block import BlockState
from kvtierd.token_bytes import pack_token_ids
from tests.factories import (
    BLOCK_SIZE,
    NAMESPACE,
    ContentPool,
    FakeClock,
    commit_all,
    hashes,
    make_index,
    run_request,
    stats_index,
    tokens,
)

PROMPT = tokens(100, 3 * BLOCK_SIZE)  # three full blocks


def queue_ids(index) -> list[int]:
    return [block.block_id for block in index.free_queue]


def snapshot(index):
    """Everything a failed call must leave unchanged."""
    return (queue_ids(index), {h: [b.block_id for b in index.hash_to_blocks.copies(h)] for h in index.hash_to_blocks},
            {r: [b.block_id for b in t] for r, t in index.tables.items()},
            [(b.ref_cnt, b.block_hash) for b in index.blocks])


def test_a_new_index_is_all_empty_blocks_on_the_queue():
    index = make_index(4)
    assert queue_ids(index) == [0, 1, 2, 3]
    assert {block.state for block in index.blocks} == {BlockState.EMPTY}
    assert index.num_free_blocks == 4 and index.num_cached_blocks == 0


def test_allocate_on_a_miss_takes_fresh_blocks_from_the_head():
    index = make_index(4)
    allocation = index.allocate("r", hashes(PROMPT), num_extra_blocks=1)
    assert allocation.block_ids == [0, 1, 2, 3] and allocation.num_hit_blocks == 0
    assert {index.blocks[i].state for i in range(4)} == {BlockState.BEING_WRITTEN}
    assert index.num_free_blocks == 0


def test_commit_makes_a_full_block_shareable():
    index = make_index(max_pending_events=100)
    index.allocate("r", hashes(PROMPT))
    chain = commit_all(index, "r", PROMPT)
    assert [index.hash_to_block[h].block_id for h in chain] == [0, 1, 2]
    assert index.blocks[1].state is BlockState.IN_USE_SHAREABLE
    assert index.blocks[1].parent_hash == chain[0]
    packed = [pack_token_ids(PROMPT[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE]) for i in range(3)]
    assert index.take_events() == [BlockStored(chain[0], NAMESPACE.root, 0, packed[0]),
                                   BlockStored(chain[1], chain[0], 1, packed[1]),
                                   BlockStored(chain[2], chain[1], 2, packed[2])]


def test_free_walks_tail_first_and_keeps_content():
    index = make_index(4)
    run_request(index, "r", PROMPT)
    index.free("r")
    # block 3 was never taken; the request's blocks follow tail first: 2, 1, 0.
    assert queue_ids(index) == [3, 2, 1, 0]
    assert [index.blocks[i].state for i in range(3)] == [BlockState.CACHED] * 3
    assert index.num_cached_blocks == 3 and "r" not in index.tables


def test_a_hit_on_a_cached_block_leaves_the_free_queue():
    index = make_index(6)
    run_request(index, "a", PROMPT)
    index.free("a")
    allocation = index.allocate("b", hashes(PROMPT), num_extra_blocks=1, token_ids=PROMPT)
    assert allocation.block_ids[:3] == [0, 1, 2] and allocation.num_hit_blocks == 3
    assert allocation.block_ids[3] == 3  # the fresh block comes from the head
    assert queue_ids(index) == [4, 5]
    assert all(index.blocks[i].ref_cnt == 1 for i in range(3))


def test_a_hit_on_a_block_in_use_shares_it():
    index = make_index()
    run_request(index, "a", PROMPT)
    allocation = index.allocate("b", hashes(PROMPT))
    assert allocation.num_hit_blocks == 3 and allocation.block_ids == index.block_table("a")
    assert [index.blocks[i].ref_cnt for i in range(3)] == [2, 2, 2]


def test_the_first_miss_ends_the_walk():
    index = make_index()
    run_request(index, "a", PROMPT)
    changed = list(PROMPT)
    changed[BLOCK_SIZE] += 1  # block 1 differs; block 2's tokens are the same but its chain is not
    allocation = index.allocate("b", hashes(changed))
    assert allocation.num_hit_blocks == 1
    assert allocation.block_ids[0] == 0 and set(allocation.block_ids[1:]).isdisjoint({1, 2})


def test_a_hash_whose_stored_parent_differs_is_a_miss():
    """Block 1 of chain A is not a hit after block 0 of chain B, even if named by hash."""
    index = make_index()
    run_request(index, "a", PROMPT)
    chain_a = hashes(PROMPT)
    other = tokens(500, BLOCK_SIZE)
    run_request(index, "b", other)
    assert index.lookup([hashes(other)[0], chain_a[1]]) == 1


def test_a_collision_is_a_miss_when_tokens_are_verified():
    """A lookup that carries token ids is checked against the stored ones."""
    index = make_index()
    run_request(index, "a", PROMPT)
    forged = list(PROMPT)
    forged[2 * BLOCK_SIZE + 1] += 7  # as if block 2's hash collided for other tokens
    assert index.lookup(hashes(PROMPT), PROMPT) == 3
    assert index.lookup(hashes(PROMPT), forged) == 2
    assert index.allocate("b", hashes(PROMPT), token_ids=forged).num_hit_blocks == 2


def test_popping_a_cached_block_evicts_it():
    evicted = []
    index = make_index(3, on_evict=lambda blocks: evicted.extend((b.block_id, b.block_hash) for b in blocks),
                       max_pending_events=100)
    run_request(index, "a", PROMPT)
    chain = hashes(PROMPT)
    index.free("a")
    index.take_events()
    allocation = index.allocate("b", hashes(tokens(900, BLOCK_SIZE)))
    # Freed tail first, so block 2 (the last of the prompt) is the head and the victim.
    assert allocation.block_ids == [2]
    assert evicted == [(2, chain[2])]  # the hook saw the content before it was dropped
    assert chain[2] not in index.hash_to_block and index.blocks[2].block_hash is None
    assert index.take_events() == [BlockRemoved(chain[2])]
    assert index.lookup(chain) == 2
    assert index.num_evictions == 1


def test_a_failing_eviction_hook_does_not_corrupt_the_index():
    def broken_hook(blocks):
        raise OSError("tier down")
    index = make_index(3, on_evict=broken_hook)
    run_request(index, "a", PROMPT)
    chain = hashes(PROMPT)
    index.free("a")
    assert index.allocate("b", hashes(tokens(900, BLOCK_SIZE))).block_ids == [2]
    assert chain[2] not in index.hash_to_block and index.num_cached_blocks == 2


def test_committing_the_same_hash_twice_is_a_no_op():
    index = make_index()
    index.allocate("a", hashes(PROMPT))
    chain = commit_all(index, "a", PROMPT)
    assert index.commit("a", 0, chain[0], PROMPT[:BLOCK_SIZE], NAMESPACE.root) is True
    assert index.num_cached_blocks == 3


@pytest.mark.parametrize("case, error", [
    ("partial block", InvalidArgument),
    ("hash length", InvalidArgument),
    ("position", InvalidArgument),
    ("parent", InvalidArgument),
    ("root", InvalidArgument),
    ("unknown request", NotFound),
    ("other hash", FailedPrecondition),
])
def test_bad_commits_are_refused_and_change_nothing(case, error):
    index = make_index()
    index.allocate("a", hashes(PROMPT), num_extra_blocks=1)
    other = tokens(700, BLOCK_SIZE)
    index.allocate("fresh", hashes(other))
    chain = hashes(PROMPT)
    index.commit("a", 0, chain[0], PROMPT[:BLOCK_SIZE], NAMESPACE.root)
    block1 = PROMPT[BLOCK_SIZE:2 * BLOCK_SIZE]
    args = {
        "partial block": ("a", 1, chain[1], block1[:-1], chain[0]),
        "hash length": ("a", 1, chain[1][:16], block1, chain[0]),
        "position": ("a", 9, chain[1], block1, chain[0]),
        "parent": ("a", 1, chain[1], block1, chain[2]),
        "root": ("fresh", 0, hashes(other)[0], other, chain[1]),
        "unknown request": ("zz", 1, chain[1], block1, chain[0]),
        "other hash": ("a", 0, chain[1], PROMPT[:BLOCK_SIZE], NAMESPACE.root),
    }[case]
    before = snapshot(index)
    with pytest.raises(error):
        index.commit(*args)
    assert snapshot(index) == before


def test_allocate_when_the_pool_is_short_changes_nothing():
    index = make_index(4)
    run_request(index, "a", PROMPT)
    before = snapshot(index)
    with pytest.raises(ResourceExhausted, match="need 2 free blocks, 1 available"):
        index.allocate("b", hashes(tokens(700, 2 * BLOCK_SIZE)))
    assert snapshot(index) == before
    assert not index.can_allocate(hashes(tokens(700, 2 * BLOCK_SIZE)))
    assert index.can_allocate(hashes(PROMPT), num_extra_blocks=1)


def test_cached_hits_count_against_the_free_blocks_they_leave():
    """A hit on a cached block takes it off the queue: it cannot also serve as a fresh block."""
    index = make_index(4)
    run_request(index, "a", PROMPT)
    index.free("a")
    assert index.can_allocate(hashes(PROMPT), num_extra_blocks=1)
    assert not index.can_allocate(hashes(PROMPT), num_extra_blocks=2)
    with pytest.raises(ResourceExhausted):
        index.allocate("b", hashes(PROMPT), num_extra_blocks=2)
    assert index.num_free_blocks == 4 and index.num_cached_blocks == 3


def test_bad_requests_change_nothing():
    index = make_index()
    run_request(index, "a", PROMPT)
    before = snapshot(index)
    for call, error in [
        (lambda: index.allocate("a", hashes(PROMPT)), FailedPrecondition),
        (lambda: index.allocate("b", [b"short"]), InvalidArgument),
        (lambda: index.allocate("b", hashes(PROMPT), -1), InvalidArgument),
        (lambda: index.allocate("b", hashes(PROMPT), token_ids=PROMPT[:5]), InvalidArgument),
        (lambda: index.free("nobody"), NotFound),
        (lambda: index.fork("nobody", "c"), NotFound),
        (lambda: index.fork("a", "a"), FailedPrecondition),
        (lambda: index.append_blocks("nobody", 1), NotFound),
        (lambda: index.append_blocks("a", 99), ResourceExhausted),
        (lambda: index.prepare_write("a", 7), InvalidArgument),
    ]:
        with pytest.raises(error):
            call()
        assert snapshot(index) == before


def test_append_blocks_grows_the_table_from_the_head():
    index = make_index(5)
    run_request(index, "a", PROMPT)
    assert index.append_blocks("a", 2) == [3, 4]
    assert index.block_table("a") == [0, 1, 2, 3, 4]


def test_fork_shares_every_block_and_free_gives_them_back():
    index = make_index()
    allocation = run_request(index, "a", PROMPT, num_extra_blocks=1)
    assert index.fork("a", "b") == allocation.block_ids
    assert [index.blocks[i].ref_cnt for i in allocation.block_ids] == [2, 2, 2, 2]
    index.free("b")
    assert [index.blocks[i].ref_cnt for i in allocation.block_ids] == [1, 1, 1, 1]
    assert index.num_free_blocks == 4


def test_a_write_into_a_block_held_once_goes_in_place():
    pool = ContentPool(8)
    index = make_index(copy_block=pool.copy_block)
    allocation = run_request(index, "a", PROMPT, num_extra_blocks=1)
    target = index.prepare_write("a", 3)
    assert target.block_id == allocation.block_ids[3] and target.copied_from is None
    assert pool.copies == []


def test_a_write_into_a_shared_block_copies_it_first():
    pool = ContentPool(8)
    index = make_index(copy_block=pool.copy_block)
    allocation = run_request(index, "a", PROMPT, num_extra_blocks=1)
    index.fork("a", "b")
    tail = allocation.block_ids[3]
    pool.content[tail] = 42
    target = index.prepare_write("b", 3)
    assert target.copied_from == tail and target.block_id not in allocation.block_ids
    assert pool.copies == [(tail, target.block_id)] and pool.content[target.block_id] == 42
    assert index.block_table("b")[3] == target.block_id and index.block_table("a")[3] == tail
    assert index.blocks[tail].ref_cnt == 1 and index.blocks[target.block_id].ref_cnt == 1


def test_a_write_into_a_committed_block_is_refused():
    index = make_index()
    run_request(index, "a", PROMPT)
    before = snapshot(index)
    with pytest.raises(FailedPrecondition, match="immutable"):
        index.prepare_write("a", 0)
    assert snapshot(index) == before


def test_a_copy_on_write_without_a_free_block_changes_nothing():
    index = make_index(4)
    run_request(index, "a", PROMPT, num_extra_blocks=1)
    index.fork("a", "b")
    before = snapshot(index)
    with pytest.raises(ResourceExhausted):
        index.prepare_write("b", 3)
    assert snapshot(index) == before


def test_evict_drops_cached_blocks_to_the_head_and_skips_blocks_in_use():
    index = make_index(6, max_pending_events=100)
    run_request(index, "a", PROMPT)
    chain = hashes(PROMPT)
    run_request(index, "b", tokens(300, BLOCK_SIZE))
    other = hashes(tokens(300, BLOCK_SIZE))
    index.free("a")
    index.take_events()
    assert index.evict([chain[1], other[0], b"\x00" * 32]) == 1  # b's block is in use
    assert queue_ids(index)[0] == 1 and index.blocks[1].state is BlockState.EMPTY
    assert index.take_events() == [BlockRemoved(chain[1])]
    assert index.lookup(chain) == 1 and index.lookup(other) == 1


def test_reset_is_refused_while_blocks_are_in_use():
    index = make_index(max_pending_events=100)
    run_request(index, "a", PROMPT)
    index.take_events()
    before = snapshot(index)
    assert index.reset() is False
    assert snapshot(index) == before and index.take_events() == []


def test_reset_forgets_every_cached_block():
    index = make_index(max_pending_events=100)
    run_request(index, "a", PROMPT)
    chain = hashes(PROMPT)
    index.free("a")
    index.take_events()
    assert index.reset() is True
    assert index.lookup(chain) == 0 and index.num_cached_blocks == 0
    assert {block.state for block in index.blocks} == {BlockState.EMPTY}
    assert index.take_events() == [AllBlocksCleared()]


def test_events_are_drained_once_and_bounded():
    index = make_index(max_pending_events=2)
    run_request(index, "a", PROMPT)  # three stored events into a queue of two
    events = index.take_events()
    assert [event.block_id for event in events] == [1, 2] and index.num_dropped_events == 1
    assert index.take_events() == []
    assert make_index().take_events() == []  # events off by default


def test_the_event_doorbell_rings_when_the_queue_goes_from_empty_to_not_empty():
    """One ring per batch of events between two takes; a doorbell set on a queue holding events rings at once."""
    index = make_index(6, max_pending_events=100)
    run_request(index, "a", PROMPT)  # three stored events, no doorbell yet
    rings = []
    index.set_event_doorbell(lambda: rings.append(len(rings)))
    assert rings == [0]
    run_request(index, "b", tokens(300, BLOCK_SIZE))  # more events while some wait: no ring
    assert rings == [0] and len(index.take_events()) == 4
    run_request(index, "c", tokens(500, BLOCK_SIZE))
    assert rings == [0, 1]
    index.free("a")
    index.free("b")
    index.take_events()
    assert index.evict(hashes(PROMPT)) == 3 and rings == [0, 1, 2]  # removals ring too
    make_index().set_event_doorbell(lambda: rings.append(-1))  # events off: never rung
    assert rings == [0, 1, 2]


def test_metrics_hooks_report_tokens_evictions_and_gaps():
    index, stats, clock = stats_index(3)
    run_request(index, "a", PROMPT)  # t=1000: 3 blocks committed
    clock.advance(10)
    index.free("a")  # t=1010
    clock.advance(30)
    assert index.allocate("b", hashes(PROMPT)).num_hit_blocks == 3  # t=1040: reuse gap 30 s
    assert stats.num_query_tokens == 6 * BLOCK_SIZE and stats.num_hit_tokens == 3 * BLOCK_SIZE
    assert list(stats.reuse_gap_s.values) == [30.0, 30.0, 30.0]
    index.free("b")  # t=1040
    clock.advance(5)
    index.allocate("c", hashes(tokens(900, BLOCK_SIZE)))  # t=1045: evicts one block
    assert stats.num_evictions == 1
    assert list(stats.idle_before_evict_s.values) == [5.0]
    assert list(stats.lifetime_s.values) == [45.0]
    assert stats.hit_rate == pytest.approx(3 / 7)  # 3 hit blocks of 3 + 3 + 1 queried


def test_clock_default_is_monotonic_time():
    index = make_index(clock=FakeClock(5.0))
    run_request(index, "a", PROMPT)
    assert index.blocks[0].committed_at_s == 5.0


def test_commit_blocks_commits_a_prefill_in_one_call():
    index = make_index(max_pending_events=100)
    index.allocate("a", hashes(PROMPT))
    chain = hashes(PROMPT)
    assert index.commit_blocks("a", 0, chain, PROMPT, NAMESPACE.root) == 3
    assert [index.blocks[i].parent_hash for i in index.block_table("a")] == [NAMESPACE.root, chain[0], chain[1]]
    assert [index.blocks[i].token_ids for i in index.block_table("a")] == [
        b"".join(t.to_bytes(4, "little") for t in PROMPT[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE]) for i in range(3)]
    assert len(index.take_events()) == 3


def test_commit_blocks_without_tokens_caches_the_blocks_for_lookups_that_pass_no_tokens():
    """An engine that keys blocks by its own content hash (SGLang's storage API) commits no tokens:
    the blocks are cached and found by hash; a lookup that passes tokens cannot verify them (a miss)."""
    index = make_index(max_pending_events=100)
    index.allocate("a", hashes(PROMPT))
    chain = hashes(PROMPT)
    assert index.commit_blocks("a", 0, chain, b"", NAMESPACE.root) == 3
    assert [index.blocks[i].token_ids for i in index.block_table("a")] == [b"", b"", b""]
    assert index.lookup(chain) == 3
    assert index.lookup(chain, PROMPT) == 0
    stored = [event for event in index.take_events() if isinstance(event, BlockStored)]
    assert [event.token_ids for event in stored] == [b"", b"", b""]


def test_commit_blocks_is_all_or_nothing():
    index = make_index()
    index.allocate("a", hashes(PROMPT))
    chain = hashes(PROMPT)
    before = snapshot(index)
    for bad_args in [("a", 0, [chain[0], chain[1], b"x" * 31], PROMPT, NAMESPACE.root),
                     ("a", 1, chain, PROMPT, chain[0]),  # runs past the table
                     ("a", 0, chain, PROMPT[:-1], NAMESPACE.root),
                     ("a", 0, [], [], NAMESPACE.root)]:
        with pytest.raises(InvalidArgument):
            index.commit_blocks(*bad_args)
        assert snapshot(index) == before


def test_commit_blocks_continues_after_committed_blocks():
    index = make_index()
    index.allocate("a", hashes(PROMPT))
    chain = hashes(PROMPT)
    index.commit_blocks("a", 0, chain[:1], PROMPT[:BLOCK_SIZE], NAMESPACE.root)
    assert index.commit_blocks("a", 1, chain[1:], PROMPT[BLOCK_SIZE:], chain[0]) == 2
    assert index.lookup(chain, PROMPT) == 3


def test_commit_blocks_undoes_its_own_commits_when_a_later_block_conflicts():
    index = make_index(max_pending_events=100)
    index.allocate("a", hashes(PROMPT))
    chain = hashes(PROMPT)
    foreign = bytes(range(32))
    index.commit_blocks("a", 2, [foreign], PROMPT[2 * BLOCK_SIZE:], b"\x07" * 32)  # no committed parent yet
    index.take_events()
    before = snapshot(index)
    with pytest.raises(FailedPrecondition, match="another hash"):
        index.commit_blocks("a", 0, chain, PROMPT, NAMESPACE.root)
    assert snapshot(index) == before and index.take_events() == []
    assert index.lookup(chain) == 0


def test_a_failed_copy_on_write_returns_the_fresh_block():
    def broken_copy(src, dst):
        raise RuntimeError("device copy failed")
    index = make_index(copy_block=broken_copy)
    run_request(index, "a", PROMPT, num_extra_blocks=1)
    index.fork("a", "b")
    before = snapshot(index)
    with pytest.raises(RuntimeError):
        index.prepare_write("b", 3)
    assert snapshot(index) == before  # no block leaked, no table repointed


def test_hold_keeps_blocks_from_eviction_until_freed():
    index = make_index(3)
    run_request(index, "a", PROMPT)
    index.free("a")
    index.hold(("copy", 1), [0, 2])  # a copy reads blocks 0 and 2
    assert index.num_free_blocks == 1 and index.blocks[0].ref_cnt == 1
    assert index.allocate("b", hashes(tokens(900, BLOCK_SIZE))).block_ids == [1]
    with pytest.raises(ResourceExhausted):
        index.allocate("c", hashes(tokens(950, BLOCK_SIZE)))
    index.free(("copy", 1))
    assert index.lookup(hashes(PROMPT)) == 1  # block 1 went to "b"; 0 is still cached
    with pytest.raises(InvalidArgument):
        index.hold("x", [99])
