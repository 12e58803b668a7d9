"""Put and Get as the daemon serves them: the tier manager's use cases (tiering/block_io.py) driven
from the event loop, with the tenant's device quota (quotas.py) held while they hold T0 blocks.

The loop waits on no copy: Put writes its blocks `PUT_BATCH_BLOCKS` at a time on the default
executor, one batch while the next is received; Get serializes its blocks there
(`GET_BATCH_BLOCKS` at a time, one batch while the one before is sent, or a chunk of T3's part as
it lands), and Get's start runs there when it may wait on the shared store (off_loop.py).

Quota holds: a Put checks each batch before writing it, adds the blocks it took once written,
and gives them all back when it closes; a Get checks the blocks it admits before taking them,
adds them once, and gives them back when it releases them. Neither releases blocks that a write
or a serialization in flight still touches: a call cancelled meanwhile releases (and gives its
quota back) when that returns, from a done-callback, with no await on the way out that a second
cancellation could skip.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
from collections.abc import AsyncGenerator, AsyncIterable, Callable, Sequence
from typing import TypeVar

from kvtierd.daemon_key import DaemonKey
from kvtierd.errors import InvalidArgument
from kvtierd.node.off_loop import call_blocking_if
from kvtierd.node.pools import LayoutPool
from kvtierd.node.quotas import QuotaBook
from kvtierd.node.tenants import Tenant
from kvtierd.tiering.block_io import BlockGet, BlockPut, PutBlock
from kvtierd.token_bytes import TokenBytes

PUT_BATCH_BLOCKS = 16  # blocks written together by Put (off the loop)
GET_BATCH_BLOCKS = 8  # blocks serialized together by Get (off the loop)

Frame = TypeVar("Frame")
Encode = Callable[[int, memoryview], Frame]  # (position in the chain, the block's bytes) -> what Get yields


class BlockTransfers:
    """The node's Puts and Gets; each runs on a private request of its pool's tier manager."""

    def __init__(self, quotas: QuotaBook) -> None:
        self.quotas = quotas
        self._request_ids = itertools.count()

    async def put(self, tenant: Tenant, pool: LayoutPool, parent: DaemonKey, blocks: AsyncIterable[PutBlock],
                  check_complete: Callable[[int], object] = lambda num_blocks: None) -> BlockPut:
        """Write `blocks` (the chain after the key `parent`) into the pool's T0 batch by batch, and
        commit them all once the stream has ended well and `check_complete(the stream's number of
        blocks)` has returned; returns the finished Put (its counts). InvalidArgument for a block of
        the wrong size or an empty stream, or whatever `check_complete` raises: nothing is committed."""
        quotas, loop = self.quotas, asyncio.get_running_loop()
        bytes_per_block = pool.layout.bytes_per_block
        put = pool.manager.start_put(("put", next(self._request_ids)), parent)
        writing: asyncio.Future[int] | None = None
        num_admitted_blocks = 0

        async def written() -> None:  # the write in flight, if any, has landed; its blocks are counted
            nonlocal writing, num_admitted_blocks
            if writing is not None:
                num_taken = await asyncio.shield(writing)
                writing = None
                quotas.add(tenant.name, num_taken * bytes_per_block)
                num_admitted_blocks += num_taken

        async def write(batch: list[PutBlock]) -> None:  # copied off the loop while the next batch arrives
            nonlocal writing
            await written()  # one write in flight: batches land in order, each checked after the last counted
            quotas.check(tenant.name, len(batch) * bytes_per_block)
            writing = loop.run_in_executor(None, put.write, batch)

        try:
            batch: list[PutBlock] = []
            async for block in blocks:
                put.check(block)
                batch.append(block)
                if len(batch) == PUT_BATCH_BLOCKS:
                    await write(batch)
                    batch = []
            await written()
            if not batch and put.num_blocks == 0:
                raise InvalidArgument("Put needs at least one block")
            await write(batch)
            await written()
            check_complete(put.num_blocks)
            put.commit()
            return put
        finally:
            def close(_: object = None) -> None:  # once no write is in flight into the request's blocks
                if writing is not None and not writing.cancelled():
                    writing.exception()  # a write's error after the stream's own was raised: retrieved, not logged
                put.close()
                quotas.remove(tenant.name, num_admitted_blocks * bytes_per_block)

            if writing is not None and not writing.done():
                writing.add_done_callback(close)
            else:
                close()

    async def get(self, tenant: Tenant, pool: LayoutPool, keys: list[DaemonKey], token_ids: TokenBytes | None,
                  encode: Encode[Frame]) -> AsyncGenerator[Frame, None]:
        """The chain's leading blocks that any tier holds, each as `encode(position, its bytes)`
        (run off the loop), in chain order: first those promoted into T0, then T3's part as it
        lands (tiering/remote_stream.py). Nothing when no tier holds the first block.
        ResourceExhausted, taking nothing, when the tenant's quota cannot hold them."""
        quotas, manager = self.quotas, pool.manager
        bytes_per_block = pool.layout.bytes_per_block
        start_get = functools.partial(manager.start_get, ("get", next(self._request_ids)), keys, token_ids,
                                      lambda num_blocks: quotas.check(tenant.name, num_blocks * bytes_per_block))
        get = await call_blocking_if(manager.has_remote, start_get, BlockGet.close)
        if get.num_blocks == 0:
            return
        nbytes = get.num_blocks * bytes_per_block
        quotas.add(tenant.name, nbytes)
        loop = asyncio.get_running_loop()
        encoding: asyncio.Future[list[Frame]] | None = None
        try:
            num_ready = await asyncio.shield(asyncio.wrap_future(get.future))
            if num_ready:  # serialized off the loop, in one copy, each batch while the one before is sent
                encoding = loop.run_in_executor(None, _encode_blocks, get, encode, 0, num_ready)
            for start in range(0, num_ready, GET_BATCH_BLOCKS):
                assert encoding is not None
                frames = await asyncio.shield(encoding)
                next_start = start + GET_BATCH_BLOCKS
                encoding = (loop.run_in_executor(None, _encode_blocks, get, encode, next_start, num_ready)
                            if next_start < num_ready else None)
                for frame in frames:
                    yield frame
            if get.remote is not None and num_ready == get.num_local_blocks:  # T3's part, as it lands
                for chunk in get.remote.chunks():
                    payloads = await asyncio.shield(asyncio.wrap_future(chunk))
                    encoding = loop.run_in_executor(None, _encode_payloads, encode, num_ready, payloads)
                    for frame in await asyncio.shield(encoding):
                        yield frame
                    num_ready += len(payloads)
        finally:  # no await here: a cancelled stream must still release, once nothing reads its blocks
            def release(_: object = None) -> None:
                if get.future.done():
                    get.close()
                else:  # waits for the promotion
                    loop.run_in_executor(None, get.close)
                quotas.remove(tenant.name, nbytes)

            if encoding is not None and not encoding.done():
                encoding.add_done_callback(release)
            else:
                release()


def _encode_blocks(get: BlockGet, encode: Encode[Frame], start: int, stop: int) -> list[Frame]:
    """The Get's blocks from `start` on, a batch of them, before `stop`, encoded."""
    return [encode(i, get.block_bytes(i)) for i in range(start, min(start + GET_BATCH_BLOCKS, stop))]


def _encode_payloads(encode: Encode[Frame], start: int, payloads: Sequence[memoryview]) -> list[Frame]:
    """Blocks `start`, `start + 1`, ... of the chain from their bytes, encoded."""
    return [encode(start + i, payload) for i, payload in enumerate(payloads)]
