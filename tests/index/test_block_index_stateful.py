"""Thousands of random allocate / commit / fork / write / free / evict / reset steps, with every
invariant of the block index checked after each step."""

from __future__ import annotations

import itertools
from collections import Counter

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvtierd.errors import FailedPrecondition, ResourceExhausted
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
        self.index = make_index(NUM_BLOCKS, copy_block=self.pool.copy_block, clock=self.clock)
        self.prompt_of: dict[int, int] = {}  # request → which prompt it runs
        self.expected: dict[int, list[int | None]] = {}  # request → content it expects per position
        self.next_content = itertools.count(1)
        self.next_request = itertools.count()

    # ------------------------------------------------------------------ steps

    @rule(which=st.integers(0, len(PROMPTS) - 1), num_extra=st.integers(0, 2))
    def allocate(self, which, num_extra):
        request = next(self.next_request)
        prompt, chain = PROMPTS[which], CHAINS[which]
        num_partial = 1 if len(prompt) % BLOCK_SIZE else 0
        try:
            allocation = self.index.allocate(request, chain, num_partial + num_extra, prompt)
        except ResourceExhausted:
            assert not self.index.can_allocate(chain, num_partial + num_extra, prompt)
            return
        self.prompt_of[request] = which
        hits = allocation.block_ids[:allocation.num_hit_blocks]
        self.expected[request] = ([self.pool.content[b] for b in hits]
                                  + [None] * (len(allocation.block_ids) - len(hits)))
        self.clock.advance(1)

    @precondition(lambda self: self.index.tables)
    @rule(data=st.data())
    def commit(self, data):
        """A runner writes a full block's KV (copying it first if shared), then commits it."""
        request = data.draw(st.sampled_from(sorted(self.index.tables)))
        which = self.prompt_of[request]
        prompt, chain = PROMPTS[which], CHAINS[which]
        if not chain:
            return
        position = data.draw(st.integers(0, len(chain) - 1))
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
        stored = self.index.commit(request, position, chain[position],
                                   prompt[position * BLOCK_SIZE:(position + 1) * BLOCK_SIZE], parent)
        assert stored == (self.index.hash_to_block[chain[position]] is block)

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
        request = data.draw(st.sampled_from(sorted(self.index.tables)))
        self.index.free(request)
        del self.expected[request], self.prompt_of[request]
        self.clock.advance(1)

    @rule(victims=st.lists(st.sampled_from(ALL_HASHES), max_size=4))
    def evict(self, victims):
        cached_free = {h for h in victims if h in self.index.hash_to_block
                       and self.index.hash_to_block[h].ref_cnt == 0}
        assert self.index.evict(victims) == len(cached_free)
        assert not cached_free & self.index.hash_to_block.keys()

    @rule()
    def reset(self):
        in_use = any(block.ref_cnt for block in self.index.blocks)
        assert self.index.reset() is (not in_use)
        if not in_use:
            assert not self.index.hash_to_block

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
    def no_hash_maps_to_two_blocks(self):
        mapped = self.index.hash_to_block
        assert len({id(block) for block in mapped.values()}) == len(mapped)
        assert all(block.block_hash == h for h, block in mapped.items())
        assert sum(block.block_hash is not None for block in self.index.blocks) == len(mapped)

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
        for block_hash, block in self.index.hash_to_block.items():
            assert self.pool.content[block.block_id] == content_of(block_hash)

    def teardown(self):
        for request in list(self.index.tables):
            self.index.free(request)
        assert self.index.num_free_blocks == NUM_BLOCKS


def content_of(block_hash: bytes) -> int:
    return -int.from_bytes(block_hash[:6], "little") - 1  # negative: never a write counter


TestBlockIndexStateMachine = BlockIndexMachine.TestCase
TestBlockIndexStateMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
