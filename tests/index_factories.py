"""Factories for block index tests: a small namespace, a fake clock, a content-tracking pool."""

from __future__ import annotations

from kvtierd.block_hash import Namespace
from kvtierd.block_index import BlockIndex
from kvtierd.index_metrics import IndexStats
from kvtierd.layout import Layout

BLOCK_SIZE = 4
NAMESPACE = Namespace(Layout("test-model", 2, 2, 8, BLOCK_SIZE))


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
