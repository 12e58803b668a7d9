"""Put and Get as tier-manager operations, without grpc: bytes in, bytes out from any tier,
counted in the hit-rate counters like Acquire; a failed Put commits nothing and leaks nothing."""

from __future__ import annotations

import pytest
import torch

from kvtierd.errors import InvalidArgument, ResourceExhausted
from kvtierd.t2.ssd_tier import SsdTierConfig
from kvtierd.tiering.block_io import PutBlock
from kvtierd.tiering.tier_config import EdgePolicy
from kvtierd.token_bytes import pack_token_ids
from tests.factories import BLOCK_SIZE, NAMESPACE, tokens
from tests.tiering.tier_factories import content_for, make_manager

PROMPT = tokens(100, 4 * BLOCK_SIZE)
CHAIN = NAMESPACE.hash_blocks(PROMPT)


def put_blocks(token_ids: list[int]) -> list[PutBlock]:
    chain = NAMESPACE.hash_blocks(token_ids)
    return [PutBlock(h, pack_token_ids(token_ids[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE]),
                     memoryview(content_for(h).contiguous().view(-1).view(torch.uint8).numpy()))
            for i, h in enumerate(chain)]


def put(manager, token_ids: list[int], request_id="put", batch_blocks: int = 16):
    blocks = put_blocks(token_ids)
    writer = manager.start_put(request_id, NAMESPACE.root)
    try:
        for start in range(0, len(blocks), batch_blocks):
            writer.write(blocks[start:start + batch_blocks])
        writer.commit()
    finally:
        writer.close()
    return writer


def get(manager, chain: list[bytes], token_ids: list[int] | None, request_id="get") -> list[bytes]:
    reader = manager.start_get(request_id, chain, token_ids)
    try:
        if reader.future is None:
            return []
        return [bytes(reader.block_bytes(i)) for i in range(reader.future.result(10))]
    finally:
        reader.close()


def expected(chain: list[bytes]) -> list[bytes]:
    return [bytes(content_for(h).contiguous().view(-1).view(torch.uint8).numpy()) for h in chain]


@pytest.fixture
def manager():
    manager = make_manager()
    yield manager
    manager.close()


def test_put_then_get_returns_the_bytes_and_counts_both(manager):
    """Two batches (the second appended), committed, released: cached; Get reads them back."""
    writer = put(manager, PROMPT, batch_blocks=3)
    assert (writer.num_blocks, writer.num_already_cached) == (4, 0)
    assert manager.index.num_free_blocks == manager.index.num_blocks  # released
    assert get(manager, CHAIN, PROMPT) == expected(CHAIN)
    stats = manager.stats()
    assert stats.num_query_blocks == 4 + 4
    assert stats.t0.num_hit_blocks == 4  # the Get's


def test_a_put_of_cached_blocks_counts_them_as_t0_hits(manager):
    put(manager, PROMPT)
    writer = put(manager, PROMPT, request_id="again")
    assert writer.num_already_cached == 4
    assert manager.stats().t0.num_hit_blocks == 4


def test_get_asks_for_every_block_and_stops_at_the_first_miss(manager):
    put(manager, PROMPT[:2 * BLOCK_SIZE])
    assert get(manager, CHAIN, PROMPT) == expected(CHAIN[:2])
    stats = manager.stats()
    assert stats.num_query_blocks == 2 + 4  # the Put's two, then all four the Get named
    assert stats.t0.num_hit_blocks == 2


def test_get_of_nothing_cached_holds_nothing(manager):
    assert get(manager, CHAIN, PROMPT) == []
    assert manager.stats().num_query_blocks == 4
    assert manager.index.num_free_blocks == manager.index.num_blocks


def test_get_serves_blocks_only_t2_holds(tmp_path):
    config = SsdTierConfig([str(tmp_path / "ssd")], capacity_bytes=64 * 4096)
    first = make_manager(ssd_config=config, t0_to_t1=EdgePolicy.WRITE_THROUGH)
    put(first, PROMPT)
    first.close()
    second = make_manager(ssd_config=config)
    try:
        assert get(second, CHAIN, PROMPT) == expected(CHAIN)
        assert second.stats().t2.num_hit_blocks == 4
    finally:
        second.close()


def test_a_put_that_fails_midway_commits_nothing_and_releases_its_blocks(manager):
    blocks = put_blocks(PROMPT)
    writer = manager.start_put("put", NAMESPACE.root)
    writer.write(blocks[:2])
    with pytest.raises(InvalidArgument):
        writer.check(PutBlock(CHAIN[2], b"\0" * 4, blocks[2].data))  # one token where a block holds four
    writer.close()
    assert manager.index.lookup(CHAIN) == 0
    assert manager.index.num_free_blocks == manager.index.num_blocks


def test_a_put_larger_than_the_pool_is_refused_before_it_writes(manager):
    writer = manager.start_put("put", NAMESPACE.root)
    with pytest.raises(ResourceExhausted):
        writer.write(put_blocks(tokens(500, 9 * BLOCK_SIZE)))  # 9 blocks, the pool holds 8
    writer.close()
    assert manager.index.num_free_blocks == manager.index.num_blocks
