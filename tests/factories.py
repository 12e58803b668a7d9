"""Test factories: a small layout, a pattern filler for pools, and block index helpers (a small
namespace, a fake clock, a content-tracking pool)."""

from __future__ import annotations

import torch

from kvtierd.block_hash import Namespace
from kvtierd.index.block_index import BlockIndex
from kvtierd.index.index_metrics import IndexStats
from kvtierd.layout import Layout

BLOCK_SIZE = 4


def small_layout(block_size: int = 4, **overrides) -> Layout:
    """A tiny layout: 2 layers, 2 KV heads of 8 dims, fp16 (512 bytes a block at block 4)."""
    fields = dict(model_id="test-model", num_layers=2, num_kv_heads=2, head_dim=8,
                  block_size=block_size, dtype="float16")
    fields.update(overrides)
    return Layout(**fields)


def fill_pattern(pool) -> torch.Tensor:
    """Write 0, 1, 2, ... over a whole device pool (exact in fp16 below 2048); return a copy."""
    numel = pool.tensor.numel()
    assert numel < 2048
    pattern = torch.arange(numel, dtype=torch.float32, device=pool.device)
    pool.tensor.copy_(pattern.view(pool.tensor.shape))
    if pool.device.type == "cuda":
        torch.cuda.synchronize(pool.device)
    return pool.tensor.clone()


def check_copy_block_copies_exactly_one(pool) -> None:
    """copy_block(0, 2): block 2 becomes block 0, every other block keeps its bytes (4-block pool)."""
    before = fill_pattern(pool)
    pool.copy_block(0, 2)
    if pool.device.type == "cuda":
        torch.cuda.synchronize(pool.device)
    assert torch.equal(pool.tensor[2], before[0])
    for block_id in (0, 1, 3):
        assert torch.equal(pool.tensor[block_id], before[block_id])


NAMESPACE = Namespace(small_layout(BLOCK_SIZE))


class FakeClock:
    def __init__(self, now_s: float = 1000.0) -> None:
        self.now_s = now_s

    def __call__(self) -> float:
        return self.now_s

    def advance(self, seconds: float) -> None:
        self.now_s += seconds


class ContentPool:
    """A stand-in for the device pool's bytes: one integer of content per block."""

    def __init__(self, num_blocks: int) -> None:
        self.content = [0] * num_blocks
        self.copies: list[tuple[int, int]] = []

    def copy_block(self, src: int, dst: int) -> None:
        self.copies.append((src, dst))
        self.content[dst] = self.content[src]


def tokens(start: int, num_tokens: int) -> list[int]:
    return list(range(start, start + num_tokens))


def hashes(token_ids: list[int]) -> list[bytes]:
    return NAMESPACE.hash_blocks(token_ids)


def make_index(num_blocks: int = 8, **kwargs) -> BlockIndex:
    kwargs.setdefault("root", NAMESPACE.root)
    kwargs.setdefault("clock", FakeClock())
    return BlockIndex(num_blocks, BLOCK_SIZE, **kwargs)


def commit_all(index: BlockIndex, request_id, token_ids: list[int]) -> list[bytes]:
    """Commit every full block of `token_ids` held by `request_id`, as a runner does after prefill."""
    chain = hashes(token_ids)
    parent = NAMESPACE.root
    for position, block_hash in enumerate(chain):
        index.commit(request_id, position, block_hash,
                     token_ids[position * BLOCK_SIZE:(position + 1) * BLOCK_SIZE], parent)
        parent = block_hash
    return chain


def run_request(index: BlockIndex, request_id, token_ids: list[int], num_extra_blocks: int = 0):
    """Allocate, commit the full blocks, and return the allocation (the request still holds it)."""
    allocation = index.allocate(request_id, hashes(token_ids), num_extra_blocks, token_ids)
    commit_all(index, request_id, token_ids)
    return allocation


def stats_index(num_blocks: int = 8) -> tuple[BlockIndex, IndexStats, FakeClock]:
    stats, clock = IndexStats(), FakeClock()
    return make_index(num_blocks, observer=stats, clock=clock), stats, clock
