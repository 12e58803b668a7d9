"""The scenarios of the seeds, end to end through the block index (with a real CPU tensor pool)."""

from __future__ import annotations

import torch

from kvtierd.block_hash import Namespace
from kvtierd.index.block_index import BlockIndex
from kvtierd.layout import Layout
from tests.factories import FakeClock

LAYOUT = Layout("scenario-model", num_layers=2, num_kv_heads=2, head_dim=4, block_size=16)
NS = Namespace(LAYOUT, tenant="acme")


def tensor_pool(num_blocks: int) -> torch.Tensor:
    return torch.zeros((num_blocks, *LAYOUT.block_shape), dtype=LAYOUT.torch_dtype)


def make(num_blocks: int, pool: torch.Tensor | None = None, clock=None) -> BlockIndex:
    copy = (lambda src, dst: pool[dst].copy_(pool[src])) if pool is not None else None
    return BlockIndex(num_blocks, LAYOUT.block_size, root=NS.root, copy_block=copy,
                      clock=clock or FakeClock())


def prefill(index: BlockIndex, request_id, prompt: list[int], num_extra_blocks: int = 0):
    """What a runner does: acquire, then commit every full block it computed."""
    chain = NS.hash_blocks(prompt)
    allocation = index.allocate(request_id, chain, num_extra_blocks + (len(prompt) % 16 > 0), prompt)
    parent = NS.root
    for position in range(allocation.num_hit_blocks, len(chain)):
        parent = chain[position - 1] if position else NS.root
        index.commit(request_id, position, chain[position], prompt[position * 16:(position + 1) * 16], parent)
    return allocation, chain


def test_n4_fork_holds_one_copy_of_the_prompt():
    """n=4 sampling of a 40-token prompt: 3 blocks shared by four sequences, ref_cnt 4 each."""
    index = make(16)
    allocation, _ = prefill(index, "seq0", list(range(40)))
    for child in ("seq1", "seq2", "seq3"):
        index.fork("seq0", child)
    assert len(allocation.block_ids) == 3
    assert {tuple(index.block_table(f"seq{i}")) for i in range(4)} == {tuple(allocation.block_ids)}
    assert [index.blocks[i].ref_cnt for i in allocation.block_ids] == [4, 4, 4]
    assert index.num_free_blocks == 16 - 3


def test_a_write_into_a_shared_half_full_block_copies_it_and_leaves_the_others_untouched():
    pool = tensor_pool(16)
    index = make(16, pool)
    allocation, _ = prefill(index, "seq0", list(range(40)))
    b7, b3, b12 = allocation.block_ids
    pool[b12, :, :, :8] = 1.0  # the prompt's tokens 32..39 in the half-full block
    for child in ("seq1", "seq2", "seq3"):
        index.fork("seq0", child)

    target = index.prepare_write("seq0", 2)  # seq0 writes slot 9 of b12
    pool[target.block_id, :, :, 8] = 2.0

    assert target.copied_from == b12 and target.block_id not in (b7, b3, b12)
    assert index.block_table("seq0") == [b7, b3, target.block_id]
    assert index.blocks[b12].ref_cnt == 3 and index.blocks[b7].ref_cnt == 4
    assert torch.all(pool[target.block_id, :, :, :8] == 1.0)  # copied before the write
    assert torch.all(pool[b12, :, :, :8] == 1.0) and torch.all(pool[b12, :, :, 8] == 0.0)
    for other in ("seq1", "seq2", "seq3"):
        assert index.block_table(other) == [b7, b3, b12]
    # The last holder writes in place: nobody else shares it any more.
    for seq in ("seq1", "seq2"):
        index.prepare_write(seq, 2)
    assert index.prepare_write("seq3", 2).copied_from is None


def test_a_released_conversation_asked_again_30s_later_hits_fully():
    clock = FakeClock()
    index = make(64, clock=clock)
    conversation = list(range(5000, 5000 + 16 * 10))
    prefill(index, "turn1", conversation)
    index.free("turn1")
    clock.advance(30)
    prefill(index, "other", list(range(9000, 9000 + 16 * 20)))  # other traffic, room to spare
    index.free("other")
    follow_up = conversation + list(range(7000, 7020))
    allocation, chain = prefill(index, "turn2", follow_up)
    assert allocation.num_hit_blocks == 10 == len(chain) - 1


def test_free_order_keeps_prefix_heads_longest():
    """Freed tail first: under pressure the last blocks of a prompt go first, block 0 last."""
    index = make(8)
    prompt = list(range(16 * 6))
    _, chain = prefill(index, "a", prompt)
    index.free("a")
    for k in range(1, 7):
        prefill(index, f"pressure-{k}", list(range(100_000 * k, 100_000 * k + 16)))
        index.free(f"pressure-{k}")
        # The two never-used blocks went first; then the prompt loses its tail, one block a time.
        assert index.lookup(chain) == min(6, 8 - k)


def test_a_timestamp_in_front_gives_no_hits_at_the_end_keeps_the_rest():
    index = make(256)
    rules = list(range(20_000, 20_000 + 16 * 12))  # a 192-token system prompt
    def stamp(second: int) -> list[int]:
        return [1, 2, 3, 40 + second // 60, 50 + second % 60, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14]

    prefill(index, "front-0", stamp(0) + rules)
    index.free("front-0")
    allocation, _ = prefill(index, "front-1", stamp(1) + rules)
    assert allocation.num_hit_blocks == 0
    index.free("front-1")

    prefill(index, "end-0", rules + stamp(0))
    index.free("end-0")
    allocation, _ = prefill(index, "end-1", rules + stamp(1))
    assert allocation.num_hit_blocks == 12
