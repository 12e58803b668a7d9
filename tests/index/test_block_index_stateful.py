"""Thousands of random allocate / commit / fork / write / free / evict / reset steps, with every
invariant of the block index checked after each step (and the eviction hook's and the events'
promises checked as they happen)."""

from __future__ import annotations

import itertools
from collections import Counter

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvtierd.errors import FailedPrecondition, ResourceExhausted
from kvtierd.index.index_events import AllBlocksCleared, BlockRemoved, BlockStored
from kvtierd.index.kv_block import BlockState
from tests.factories import BLOCK_SIZE, NAMESPACE, ContentPool, FakeClock, make_index

NUM_BLOCKS = 10
# Prompts that share prefixes of 0, 1 and 2 blocks, with and without a partial block.
SYSTEM = list(range(1, 1 + 2 * BLOCK_SIZE))
PROMPTS = [
    SYSTEM + [90, 91, 92, 93],
    SYSTEM + [80, 81, 82, 83, 84, 85],
    SYSTEM[:BLOCK_SIZE] + [70, 71, 72, 73],
    [60, 61, 62, 63, 64, 65, 66, 67, 68],
    SYSTEM + [90, 91, 92, 93, 94, 95, 96, 97],
    [50, 51],
]
CHAINS = [NAMESPACE.hash_blocks(prompt) for prompt in PROMPTS]
ALL_HASHES = sorted({h for chain in CHAINS for h in chain})


class BlockIndexMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool = ContentPool(NUM_BLOCKS)
        self.clock = FakeClock()
        self.index = make_index(NUM_BLOCKS, copy_block=self.pool.copy_block, clock=self.clock,
                                on_evict=self.on_evict, max_pending_events=10_000)
        self.prompt_of: dict[int, int] = {}  # request → which prompt it runs
        self.expected: dict[int, list[int | None]] = {}  # request → content it expects per position
        self.next_content = itertools.count(1)
        self.next_request = itertools.count()
        self.commit_order: dict[int, int] = {}  # block → when it got its current hash
        self.next_commit = itertools.count()
        self.routed: set[bytes] = set()  # what a router applying the events believes is cached

    def on_evict(self, blocks):
        """The hook sees a block only when the last copy of its hash leaves, content intact."""
        for block in blocks:
            assert block.block_hash is not None and block.block_hash not in self.index.hash_to_blocks
            assert self.pool.content[block.block_id] == content_of(block.block_hash)

    # ------------------------------------------------------------------ steps

    @rule(which=st.integers(0, len(PROMPTS) - 1), num_extra=st.integers(0, 2), recompute_last=st.booleans())
    def allocate(self, which, num_extra, recompute_last):
        """`recompute_last`: look up as vLLM does, one token short, so a fully cached prompt
        computes its last block again and commits a second copy of it."""
        self.allocate_request(next(self.next_request), which, num_extra, recompute_last)

    def allocate_request(self, request, which, num_extra, recompute_last):
        prompt, chain = PROMPTS[which], CHAINS[which]
        num_lookup = (len(prompt) - 1) // BLOCK_SIZE if recompute_last else len(chain)
        num_fresh = -(-len(prompt) // BLOCK_SIZE) - num_lookup + num_extra
        try:
            allocation = self.index.allocate(request, chain[:num_lookup], num_fresh, prompt)
        except ResourceExhausted:
            assert not self.index.can_allocate(chain[:num_lookup], num_fresh, prompt)
            return None
        self.prompt_of[request] = which
        hits = allocation.block_ids[:allocation.num_hit_blocks]
        self.expected[request] = ([self.pool.content[b] for b in hits]
                                  + [None] * (len(allocation.block_ids) - len(hits)))
        self.clock.advance(1)
        return allocation

    @rule(which=st.integers(0, len(PROMPTS) - 1))
    def prefill(self, which):
        """What a vLLM-like runner does: allocate one token short, commit every full block it
        computed; a prompt cached whole commits its last block again (a second copy)."""
        request = next(self.next_request)
        allocation = self.allocate_request(request, which, 0, True)
        if allocation is not None:
            for position in range(allocation.num_hit_blocks, len(CHAINS[which])):
                self.commit_at(request, position)

    @precondition(lambda self: self.index.tables)
    @rule(data=st.data())
    def commit(self, data):
        """A runner writes a full block's KV (copying it first if shared), then commits it."""
        request = data.draw(st.sampled_from(sorted(self.index.tables)))
        chain = CHAINS[self.prompt_of[request]]
        if chain:
            self.commit_at(request, data.draw(st.integers(0, len(chain) - 1)))

    def commit_at(self, request, position):
        prompt, chain = PROMPTS[self.prompt_of[request]], CHAINS[self.prompt_of[request]]
        parent = chain[position - 1] if position else NAMESPACE.root
        block = self.index.blocks[self.index.block_table(request)[position]]
        if block.block_hash is None:
            try:
                target = self.index.prepare_write(request, position)
            except ResourceExhausted:
                return
            self.pool.content[target.block_id] = content_of(chain[position])
            self.expected[request][position] = content_of(chain[position])
            block = self.index.blocks[target.block_id]
        assert block.block_hash in (None, chain[position])
        if block.block_hash is None:
            self.commit_order[block.block_id] = next(self.next_commit)
        stored = self.index.commit(request, position, chain[position],
                                   prompt[position * BLOCK_SIZE:(position + 1) * BLOCK_SIZE], parent)
        assert stored and block in self.index.hash_to_blocks.copies(chain[position])  # a copy, maybe not the first

    @precondition(lambda self: self.index.tables)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(sorted(self.index.tables)))
        child = next(self.next_request)
        self.index.fork(parent, child)
        self.prompt_of[child] = self.prompt_of[parent]
        self.expected[child] = list(self.expected[parent])

    @precondition(lambda self: self.index.tables)
    @rule(data=st.data())
    def write(self, data):
        request = data.draw(st.sampled_from(sorted(self.index.tables)))
        table = self.index.block_table(request)
        position = data.draw(st.integers(0, len(table) - 1))
        committed = self.index.blocks[table[position]].block_hash is not None
        try:
            target = self.index.prepare_write(request, position)
        except FailedPrecondition:
            assert committed
            return
        except ResourceExhausted:
            assert self.index.num_free_blocks == 0
            return
        assert not committed
        content = next(self.next_content)
        self.pool.content[target.block_id] = content
        self.expected[request][position] = content

    @precondition(lambda self: self.index.tables)
    @rule(data=st.data())
    def free(self, data):
        """Released blocks that hold no hash go to the head, tail first; cached ones to the tail."""
        request = data.draw(st.sampled_from(sorted(self.index.tables)))
        released = [self.index.blocks[b] for b in reversed(self.index.block_table(request))
                    if self.index.blocks[b].ref_cnt == 1]
        empty = [b.block_id for b in released if b.block_hash is None]
        cached = [b.block_id for b in released if b.block_hash is not None]
        self.index.free(request)
        queued = [block.block_id for block in self.index.free_queue]
        assert queued[:len(empty)] == empty and queued[len(queued) - len(cached):] == cached
        del self.expected[request], self.prompt_of[request]
        self.clock.advance(1)

    @rule(victims=st.lists(st.sampled_from(ALL_HASHES), max_size=4))
    def evict(self, victims):
        """Every copy nobody holds is dropped; the count is of the hashes no copy of which stays."""
        copies = {h: self.index.hash_to_blocks.copies(h) for h in set(victims)}
        leaving = {h for h, blocks in copies.items() if blocks and all(b.ref_cnt == 0 for b in blocks)}
        held = {h: [b for b in blocks if b.ref_cnt > 0] for h, blocks in copies.items()}
        assert self.index.evict(victims) == len(leaving)
        for h in copies:
            assert self.index.hash_to_blocks.copies(h) == held[h]

    @rule()
    def reset(self):
        in_use = any(block.ref_cnt for block in self.index.blocks)
        assert self.index.reset() is (not in_use)
        if not in_use:
            assert not self.index.hash_to_blocks and self.index.num_duplicate_blocks == 0

    @rule()
    def free_all(self):
        for request in sorted(self.index.tables):
            self.index.free(request)
        self.expected.clear()
        self.prompt_of.clear()
        assert self.index.num_free_blocks == NUM_BLOCKS

    # ------------------------------------------------------------------ invariants

    @invariant()
    def every_block_is_in_exactly_one_state(self):
        for block in self.index.blocks:
            assert block.is_queued == (block.ref_cnt == 0)
            assert block.state is {
                (True, True): BlockState.IN_USE_SHAREABLE, (True, False): BlockState.BEING_WRITTEN,
                (False, True): BlockState.CACHED, (False, False): BlockState.EMPTY,
            }[(block.ref_cnt > 0, block.block_hash is not None)]

    @invariant()
    def ref_cnt_equals_the_number_of_table_entries(self):
        held = Counter(block.block_id for table in self.index.tables.values() for block in table)
        assert all(block.ref_cnt == held[block.block_id] for block in self.index.blocks)

    @invariant()
    def the_free_queue_holds_exactly_the_unreferenced_blocks(self):
        queued = [block.block_id for block in self.index.free_queue]
        assert len(queued) == len(set(queued)) == self.index.num_free_blocks
        assert set(queued) == {block.block_id for block in self.index.blocks if block.ref_cnt == 0}

    @invariant()
    def every_block_with_a_hash_is_a_copy_of_it_oldest_first(self):
        """A block carries a hash iff it is indexed as a copy of it; hits take the oldest copy."""
        table = self.index.hash_to_blocks
        indexed = list(table.all_blocks())
        assert len({id(block) for block in indexed}) == len(indexed)
        assert {id(b) for b in indexed} == {id(b) for b in self.index.blocks if b.block_hash is not None}
        for block_hash in table:
            copies = table.copies(block_hash)
            assert copies and all(block.block_hash == block_hash for block in copies)
            assert self.index.hash_to_block[block_hash] is copies[0]
            order = [self.commit_order[block.block_id] for block in copies]
            assert order == sorted(order), "copies are kept in the order they were committed"
        assert self.index.num_cached_blocks == len(set(self.index.cached_hashes())) == len(table)
        assert self.index.num_duplicate_blocks == len(indexed) - len(table)

    @invariant()
    def the_events_tell_a_router_exactly_what_is_cached(self):
        """BlockStored / BlockRemoved once per hash, alternating: a set applying them is the table."""
        for event in self.index.take_events():
            if isinstance(event, BlockStored):
                assert event.block_hash not in self.routed
                self.routed.add(event.block_hash)
            elif isinstance(event, BlockRemoved):
                self.routed.remove(event.block_hash)
            else:
                assert isinstance(event, AllBlocksCleared)
                self.routed.clear()
        assert self.routed == set(self.index.hash_to_blocks)

    @invariant()
    def every_request_reads_the_content_it_expects(self):
        """Nobody's write showed up in a block another request holds (copy-on-write)."""
        for request, expected in self.expected.items():
            table = self.index.block_table(request)
            for position, content in enumerate(expected):
                if content is not None:
                    assert self.pool.content[table[position]] == content, (request, position)

    @invariant()
    def cached_blocks_hold_their_hash_content(self):
        for block in self.index.hash_to_blocks.all_blocks():
            assert self.pool.content[block.block_id] == content_of(block.block_hash)

    def teardown(self):
        for request in list(self.index.tables):
            self.index.free(request)
        assert self.index.num_free_blocks == NUM_BLOCKS


def content_of(block_hash: bytes) -> int:
    return -int.from_bytes(block_hash[:6], "little") - 1  # negative: never a write counter


TestBlockIndexStateMachine = BlockIndexMachine.TestCase
TestBlockIndexStateMachine.settings = settings(stateful_step_count=40)
