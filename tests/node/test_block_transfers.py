"""Put and Get as the daemon serves them, without grpc: Put writes in batches off the loop and
commits at the end; Get streams the blocks back; each holds the tenant's device quota while it
holds blocks and gives it back, also when refused, closed early or cancelled mid-serialization."""

from __future__ import annotations

import asyncio
import threading
import types

import pytest

from kvtierd.errors import ResourceExhausted
from kvtierd.node.block_transfers import PUT_BATCH_BLOCKS, BlockTransfers
from kvtierd.node.quotas import Quota, QuotaBook
from kvtierd.node.tenants import Tenant
from kvtierd.tiering.block_io import BlockPut
from tests.factories import BLOCK_SIZE, NAMESPACE, tokens
from tests.tiering.test_block_io import expected, put_blocks
from tests.tiering.tier_factories import LAYOUT, make_manager

TENANT = Tenant.named("acme")


@pytest.fixture
def pool():
    manager = make_manager(num_device_blocks=40)
    yield types.SimpleNamespace(layout=LAYOUT, manager=manager)  # what BlockTransfers reads of a LayoutPool
    manager.close()


async def _blocks(token_ids: list[int]):
    for block in put_blocks(token_ids):
        yield block


def _put(transfers: BlockTransfers, pool, token_ids: list[int]):
    return asyncio.run(transfers.put(TENANT, pool, NAMESPACE.root, _blocks(token_ids)))


def _get_all(transfers: BlockTransfers, pool, token_ids: list[int]) -> list[tuple[int, bytes]]:
    async def main():
        frames = transfers.get(TENANT, pool, NAMESPACE.hash_blocks(token_ids), None,
                               lambda position, data: (position, bytes(data)))
        return [frame async for frame in frames]

    return asyncio.run(main())


def test_put_then_get_streams_the_blocks_in_order_and_gives_the_quota_back(pool):
    transfers = BlockTransfers(QuotaBook())
    prompt = tokens(7, 4 * BLOCK_SIZE)
    put = _put(transfers, pool, prompt)
    assert (put.num_blocks, put.num_already_cached) == (4, 0)
    chain = NAMESPACE.hash_blocks(prompt)
    assert _get_all(transfers, pool, prompt) == list(enumerate(expected(chain)))
    assert transfers.quotas.held_bytes[TENANT.name] == 0
    assert pool.manager.index.num_free_blocks == pool.manager.index.num_blocks  # neither holds a block


def test_put_writes_in_batches_of_put_batch_blocks(pool, monkeypatch):
    batches: list[int] = []
    write = BlockPut.write

    def recorded(self, batch, *args):
        batches.append(len(batch))
        return write(self, batch, *args)

    monkeypatch.setattr(BlockPut, "write", recorded)
    _put(BlockTransfers(QuotaBook()), pool, tokens(3, (2 * PUT_BATCH_BLOCKS + 3) * BLOCK_SIZE))
    assert batches == [PUT_BATCH_BLOCKS, PUT_BATCH_BLOCKS, 3]


def test_a_put_beyond_the_quota_is_refused_and_holds_nothing(pool):
    quotas = QuotaBook({TENANT.name: Quota(t0_bytes=2 * LAYOUT.bytes_per_block)})
    with pytest.raises(ResourceExhausted, match="device quota"):
        _put(BlockTransfers(quotas), pool, tokens(5, 4 * BLOCK_SIZE))
    assert quotas.held_bytes[TENANT.name] == 0
    assert pool.manager.index.num_free_blocks == pool.manager.index.num_blocks


def test_a_get_closed_after_its_first_block_releases_its_blocks_and_quota(pool):
    transfers = BlockTransfers(QuotaBook())
    prompt = tokens(11, 4 * BLOCK_SIZE)
    _put(transfers, pool, prompt)

    async def main():
        frames = transfers.get(TENANT, pool, NAMESPACE.hash_blocks(prompt), None, lambda position, data: position)
        assert await anext(frames) == 0
        assert transfers.quotas.held_bytes[TENANT.name] == 4 * LAYOUT.bytes_per_block  # held while read
        await frames.aclose()

    asyncio.run(main())
    assert transfers.quotas.held_bytes[TENANT.name] == 0
    assert pool.manager.index.num_free_blocks == pool.manager.index.num_blocks


def test_a_cancelled_get_releases_once_the_serialization_in_flight_returns(pool, monkeypatch):
    """Nothing is released while a thread still reads the blocks; then everything is."""
    transfers = BlockTransfers(QuotaBook())
    prompt = tokens(13, 4 * BLOCK_SIZE)
    _put(transfers, pool, prompt)
    entered, release = threading.Event(), threading.Event()

    def slow_encode(position: int, data: memoryview) -> int:
        entered.set()
        assert release.wait(10)
        return position

    async def main():
        async def read_all():
            async for _ in transfers.get(TENANT, pool, NAMESPACE.hash_blocks(prompt), None, slow_encode):
                pass

        task = asyncio.create_task(read_all())
        await asyncio.to_thread(entered.wait, 10)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert transfers.quotas.held_bytes[TENANT.name] == 4 * LAYOUT.bytes_per_block  # still being read
        release.set()
        for _ in range(1000):  # the release runs from the serialization's done-callback, on the loop
            if not transfers.quotas.held_bytes[TENANT.name]:
                break
            await asyncio.sleep(0.01)

    asyncio.run(main())
    assert transfers.quotas.held_bytes[TENANT.name] == 0
    assert pool.manager.index.num_free_blocks == pool.manager.index.num_blocks

