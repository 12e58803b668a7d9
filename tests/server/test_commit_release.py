"""A store's last two calls in one: Commit with release, against a real `kvtierd serve`."""

from __future__ import annotations

import asyncio

import pytest

from kvtierd.client import AsyncKvtierClient, CommitResult, KvtierClient
from kvtierd.errors import FailedPrecondition, InvalidArgument
from kvtierd.launch.daemon_process import DaemonProcess, small_daemon_args
from tests.server.e2e_runner import LAYOUT, prompt
from tests.server.test_daemon_e2e import t0_stats


def test_commit_and_release_commits_then_releases_in_one_call(tmp_path):
    """The blocks are committed (a later lookup hits them all) and the request is no longer held (every
    block free, a Release of it refused); a commit refused for its input releases nothing."""
    tokens = prompt(21, 24)
    with DaemonProcess(small_daemon_args(str(tmp_path))) as daemon, KvtierClient(daemon.address) as client:
        session = client.attach(LAYOUT, map_pool=False)
        hashes = session.namespace.hash_blocks(tokens)
        acquired = session.acquire("store", hashes, 0, token_ids=tokens, for_store=True)
        with pytest.raises(InvalidArgument, match="one hash per block"):
            session.commit_and_release("store", acquired.block_ids, hashes[:-1], tokens, None)
        assert t0_stats(client).num_free_blocks == t0_stats(client).num_blocks - len(hashes)  # still held

        result = session.commit_and_release("store", acquired.block_ids, hashes, tokens, None)

        assert result == CommitResult(num_committed_blocks=len(hashes), released=True)
        stats = t0_stats(client)
        assert stats.num_free_blocks == stats.num_blocks
        assert session.lookup(hashes, token_ids=tokens).total.num_blocks == len(hashes)
        with pytest.raises(FailedPrecondition, match="not held"):
            session.release("store")


def test_commit_and_release_of_the_async_client(tmp_path):
    """The asyncio client's call does the same."""
    tokens = prompt(22, 16)

    async def store(address: str) -> tuple[CommitResult, int]:
        async with AsyncKvtierClient(address) as client:
            session = await client.attach(LAYOUT, map_pool=False)
            hashes = session.namespace.hash_blocks(tokens)
            acquired = await session.acquire("store", hashes, 0, token_ids=tokens, for_store=True)
            result = await session.commit_and_release("store", acquired.block_ids, hashes, tokens, None)
            return result, (await session.lookup(hashes, token_ids=tokens)).total.num_blocks

    with DaemonProcess(small_daemon_args(str(tmp_path))) as daemon:
        result, num_hits = asyncio.run(store(daemon.address))
        with KvtierClient(daemon.address) as client:
            stats = t0_stats(client)
    assert result == CommitResult(4, True) and num_hits == 4
    assert stats.num_free_blocks == stats.num_blocks
