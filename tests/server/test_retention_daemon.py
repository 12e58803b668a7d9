"""Retention hints against a real `kvtierd serve`: retained blocks outlive floods in T0 and T1, are
demoted to T2 rather than dropped, lapse after their TTL, stay within the tenant's quota, never touch
another tenant's blocks, and a bad hint changes nothing."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator
from typing import cast

import grpc
import pytest

from kvtierd.chain_lookup import ChainLookup
from kvtierd.client import AsyncKvtierClient, KvtierClient
from kvtierd.client.base import map_rpc_error
from kvtierd.client.calls import Call
from kvtierd.errors import InvalidArgument
from kvtierd.launch.daemon_process import DaemonProcess, small_daemon_args, wait_until
from kvtierd.v1 import kvtier_pb2 as pb
from kvtierd.wire.block_frames import encode_put_request
from kvtierd.wire.conversions import layout_to_proto
from tests.server.e2e_runner import LAYOUT, expected_block, prompt
from tests.server.test_daemon_e2e import t0_stats

HIGH, NORMAL = pb.RetentionHint.HIGH, pb.RetentionHint.NORMAL
UNKNOWN_PRIORITY = cast("pb.RetentionHint.Priority", 7)


def small_args(directory: object, *extra: str) -> list[str]:
    """64 T0 blocks, 64 T1 slots (4 KiB each), 256 T2 slots."""
    return small_daemon_args(str(directory), t0_bytes="64KiB", host_bytes="256KiB", ssd_bytes="1MiB", extra=list(extra))


def chain(client: KvtierClient, seed: int, num_blocks: int) -> tuple[list[bytes], list[int]]:
    session = client.attach(LAYOUT, map_pool=False)
    tokens = prompt(seed, num_blocks * LAYOUT.block_size)
    hashes: list[bytes] = list(session.namespace.hash_blocks(tokens))
    session.close()
    return hashes, tokens


def put(client: KvtierClient, hashes: list[bytes], tokens: list[int], hint: pb.RetentionHint | None = None) -> None:
    """A Put of the chain, its first message carrying `hint`."""
    size = LAYOUT.block_size

    def requests() -> Iterator[bytes]:
        for i, block_hash in enumerate(hashes):
            token_bytes = b"".join(t.to_bytes(4, "little") for t in tokens[i * size:(i + 1) * size])
            yield encode_put_request(block_hash, token_bytes, expected_block(block_hash, LAYOUT.bytes_per_block),
                                     layout_to_proto(LAYOUT) if i == 0 else None, retention=hint if i == 0 else None)

    try:
        client._put(requests(), metadata=client._metadata, timeout=30)
    except grpc.RpcError as error:  # as the client maps it
        raise map_rpc_error(error, client.target) from error


def retain(client: KvtierClient, hashes: list[bytes], hint: pb.RetentionHint | None,
           action: pb.RetainRequest.Action = pb.RetainRequest.RETAIN) -> pb.RetainResponse:
    return client.retain(LAYOUT, hashes, hint, action=action)


def usage(client: KvtierClient) -> pb.TenantUsage:
    rows = client.tenant_stats()
    return rows[0] if rows else pb.TenantUsage()


def flood(client: KvtierClient, first_seed: int, num_chains: int = 20, num_blocks: int = 8) -> None:
    for seed in range(first_seed, first_seed + num_chains):
        put(client, *chain(client, seed, num_blocks))


def where(client: KvtierClient, hashes: list[bytes], tokens: list[int]) -> ChainLookup:
    with client.attach(LAYOUT, map_pool=False) as session:
        return session.lookup(hashes, token_ids=tokens)


def exact(client: KvtierClient, hashes: list[bytes], tokens: list[int]) -> bool:
    got = client.get(LAYOUT, hashes, tokens)
    return [data for _, data in got] == [expected_block(h, LAYOUT.bytes_per_block) for h in hashes]


def test_retained_chain_outlives_a_flood_then_lapses_after_its_ttl(tmp_path):
    """A HIGH hint keeps a chain in T0 through Puts that evict every other block from T0 and T1; it
    is served byte for byte; once its TTL passed the next flood evicts it like any other."""
    args = small_args(tmp_path, "--set", "policy.t1_to_t2=off")
    with DaemonProcess(args) as daemon, KvtierClient(daemon.address) as client:
        kept, kept_tokens = chain(client, 1, 8)
        other, other_tokens = chain(client, 2, 8)
        put(client, other, other_tokens)
        put(client, kept, kept_tokens)
        answer = retain(client, kept, pb.RetentionHint(retention_session="agent-1", priority=HIGH, ttl_s=3))
        assert (answer.num_found_blocks, answer.num_retained_blocks, answer.num_downgraded_blocks) == (8, 8, 0)
        assert usage(client).num_t0_retained_blocks == 8

        flood(client, 100)  # 160 blocks through a T0 of 64 and a T1 of 64

        assert where(client, other, other_tokens).total.num_blocks == 0  # the unretained chain is gone
        assert where(client, kept, kept_tokens).total.t0 == 8
        assert exact(client, kept, kept_tokens)
        assert wait_until(lambda: usage(client).num_t0_retained_blocks == 0, timeout_s=15)
        flood(client, 200)
        assert where(client, kept, kept_tokens).total.num_blocks == 0


def test_retained_blocks_leaving_t1_are_demoted_to_t2(tmp_path):
    """With policy.t1_to_t2 off, T2 gets only what demotion writes: of four retained chains of 40 blocks
    (160, against 64 in T0 and 64 in T1) none is dropped, the 32 least recently used are on T2, exact."""
    args = small_args(tmp_path, "--set", "policy.t1_to_t2=off", "--set", "retention.max_tenant_share=1")
    with DaemonProcess(args) as daemon, KvtierClient(daemon.address) as client:
        chains = [chain(client, seed, 40) for seed in range(4)]
        for hashes, tokens in chains:
            put(client, hashes, tokens, pb.RetentionHint(retention_session="agent", priority=NORMAL, ttl_s=600))
        assert wait_until(lambda: usage(client).num_t2_blocks >= 160 - 64 - 64)
        row = usage(client)
        assert (row.num_t0_cached_blocks, row.num_t1_blocks, row.num_t2_blocks) == (64, 64, 32)  # none dropped
        assert row.num_t2_retained_blocks == row.num_t2_blocks
        oldest, oldest_tokens = chains[0]
        # its tail went down first (the Put's hint moves its blocks into T0's retained class tail first,
        # and T0, then T1, evict them in that order): T1 keeps its first 8 blocks, T2 the other 32
        found = where(client, oldest, oldest_tokens)
        assert (found.total.t0, found.total.t1, found.total.t2) == (0, 8, 32)
        assert exact(client, oldest, oldest_tokens)  # the whole chain, read back from T1 and T2


def test_release_and_prefetch_through_the_asyncio_client(tmp_path):
    """RELEASE without hashes drops the session's hints everywhere; PREFETCH with a hint brings a chain
    held only on T2 up into T1 and retains it."""
    args = small_args(tmp_path, "--set", "policy.t0_to_t1=write_through")
    with DaemonProcess(args) as daemon, KvtierClient(daemon.address) as client:
        hashes, tokens = chain(client, 12, 8)
        put(client, hashes, tokens, pb.RetentionHint(retention_session="s", ttl_s=60))
        assert wait_until(lambda: usage(client).num_t0_retained_blocks == 8)  # once written through to T1
        assert wait_until(lambda: usage(client).num_t2_blocks == 8)
        client.evict(tiers=["t0", "t1"])

        async def release_then_prefetch() -> tuple[pb.RetainResponse, pb.RetainResponse]:
            async with AsyncKvtierClient(daemon.address) as aio:
                released = await aio.retain(LAYOUT, [], pb.RetentionHint(retention_session="s"),
                                            action=pb.RetainRequest.RELEASE)
                prefetched = await aio.retain(LAYOUT, hashes, pb.RetentionHint(retention_session="t", ttl_s=60),
                                              action=pb.RetainRequest.PREFETCH)
                return released, prefetched

        released, prefetched = asyncio.run(release_then_prefetch())
        assert released.num_released_hints == 8
        assert (prefetched.num_found_blocks, prefetched.num_prefetched_blocks, prefetched.num_retained_blocks) == \
            (8, 8, 8)
        assert wait_until(lambda: usage(client).num_t1_retained_blocks == 8)


def test_quota_downgrades_past_the_tenant_share_and_says_which(tmp_path):
    """retention.max_tenant_share 0.5 of 64 T0 blocks: 32 of a 48-block chain are retained, 16 are
    downgraded, and the reason names T0's quota."""
    with DaemonProcess(small_args(tmp_path)) as daemon, KvtierClient(daemon.address) as client:
        hashes, tokens = chain(client, 5, 48)
        put(client, hashes, tokens)
        answer = retain(client, hashes, pb.RetentionHint(retention_session="s", priority=HIGH, ttl_s=60))
        assert (answer.num_retained_blocks, answer.num_downgraded_blocks) == (32, 16)
        assert "T0" in answer.downgrade_reason and "50%" in answer.downgrade_reason
        assert usage(client).num_t0_retained_blocks == 32


def test_a_higher_priority_takes_the_quota_of_lower_ones_and_outlives_a_flood(tmp_path):
    """Quota 32 of 64 T0 blocks, full of LOW hints: a HIGH hint on another 8-block chain is kept
    whole (8 LOW blocks give up their room, still cached); a NORMAL one is not (equal-or-lower
    blocks keep theirs... LOW is lower: it is kept too), a second LOW one is downgraded whole.
    After a flood the HIGH chain is still in T0, byte for byte."""
    with DaemonProcess(small_args(tmp_path, "--set", "policy.t1_to_t2=off")) as daemon, \
            KvtierClient(daemon.address) as client:
        low, low_tokens = chain(client, 5, 32)
        put(client, low, low_tokens)
        answer = retain(client, low, pb.RetentionHint(retention_session="s", priority=pb.RetentionHint.LOW, ttl_s=600))
        assert (answer.num_retained_blocks, answer.num_downgraded_blocks) == (32, 0)
        high, high_tokens = chain(client, 6, 8)
        put(client, high, high_tokens)
        answer = retain(client, high, pb.RetentionHint(retention_session="s", priority=HIGH, ttl_s=60))
        assert (answer.num_retained_blocks, answer.num_downgraded_blocks) == (8, 0)
        assert usage(client).num_t0_retained_blocks == 32  # 24 LOW, 8 HIGH: the quota holds
        other, other_tokens = chain(client, 7, 8)
        put(client, other, other_tokens)
        answer = retain(client, other, pb.RetentionHint(retention_session="s", priority=pb.RetentionHint.LOW,
                                                        ttl_s=60))
        assert (answer.num_retained_blocks, answer.num_downgraded_blocks) == (0, 8)
        assert "T0" in answer.downgrade_reason

        flood(client, 100)
        assert where(client, high, high_tokens).total.t0 == 8
        assert exact(client, high, high_tokens)


def test_a_hint_of_one_tenant_changes_nothing_of_another(tmp_path):
    """Tenant acme retains a chain; globex's identical chain is neither retained nor kept through a flood."""
    tokens_file = tmp_path / "tokens"
    tokens_file.write_text("acme a-token\nglobex g-token\n")
    args = small_args(tmp_path, "--tokens-file", str(tokens_file), "--set", "policy.t1_to_t2=off")
    with (DaemonProcess(args) as daemon, KvtierClient(daemon.address, token="a-token") as acme,
          KvtierClient(daemon.address, token="g-token") as globex):
        hashes, tokens = chain(acme, 7, 8)
        put(acme, hashes, tokens)
        put(globex, hashes, tokens)
        assert retain(acme, hashes, pb.RetentionHint(retention_session="s", ttl_s=60)).num_retained_blocks == 8
        assert usage(globex).num_t0_retained_blocks == 0
        flood(globex, 300)
        assert where(globex, hashes, tokens).total.num_blocks == 0
        assert where(acme, hashes, tokens).total.t0 == 8


@pytest.mark.parametrize("hint, words", [
    (pb.RetentionHint(retention_session="s", priority=UNKNOWN_PRIORITY, ttl_s=60), "priority"),
    (pb.RetentionHint(retention_session="s", ttl_s=0), "ttl_s"),
    (pb.RetentionHint(retention_session="s", ttl_s=86401), "max_ttl_s"),
    (pb.RetentionHint(retention_session="s", ttl_s=60, start_token=0, end_token=33), "past the chain"),
    (pb.RetentionHint(retention_session="s", ttl_s=60, start_token=8, end_token=8), "start_token"),
    (pb.RetentionHint(retention_session="", ttl_s=60), "retention_session"),
    (pb.RetentionHint(retention_session="x" * 257, ttl_s=60), "retention_session"),
])
def test_a_bad_hint_is_refused_and_changes_nothing(tmp_path, hint, words):
    """Retain, Commit and Put with a bad hint: INVALID_ARGUMENT naming the field; no block retained,
    the Commit's and the Put's blocks not committed, none held."""
    with DaemonProcess(small_args(tmp_path)) as daemon, KvtierClient(daemon.address) as client:
        hashes, tokens = chain(client, 9, 8)
        put(client, hashes, tokens)
        with pytest.raises(InvalidArgument, match=words):
            retain(client, hashes, hint)
        session = client.attach(LAYOUT, map_pool=False)
        fresh, fresh_tokens = chain(client, 10, 8)
        acquired = session.acquire("r", fresh, 0, token_ids=fresh_tokens, for_store=True)
        commit = Call("Commit", pb.CommitRequest(session_id=session.session_id, request_id="r",
                                                  block_ids=acquired.block_ids, block_hashes=fresh,
                                                  token_ids=b"".join(t.to_bytes(4, "little") for t in fresh_tokens),
                                                  parent_hash=session.root_hash, release=True, retention=hint))
        with pytest.raises(InvalidArgument, match=words):
            client._run(commit)
        assert session.lookup(fresh, token_ids=fresh_tokens).total.num_blocks == 0  # nothing committed
        session.release("r")
        put_words = "past the Put" if "past the chain" in words else words  # a Put's range is known after its blocks
        refused, refused_tokens = chain(client, 11, 8)
        with pytest.raises(InvalidArgument, match=put_words):
            put(client, refused, refused_tokens, hint)
        assert where(client, refused, refused_tokens).total.num_blocks == 0  # the refused Put stored nothing
        row = usage(client)
        assert (row.num_t0_retained_blocks, row.num_t1_retained_blocks, row.num_t2_retained_blocks) == (0, 0, 0)
        stats = t0_stats(client)
        assert stats.num_free_blocks == stats.num_blocks  # nothing held


def test_retained_blocks_a_shrinking_t1_share_gives_up_are_demoted_to_t2(tmp_path):
    """Layout A alone fills the node's whole T1 (64 slots) with retained blocks; a second layout's
    demand takes half of it back. With policy.t1_to_t2 off, the blocks A's shrinking share gives up
    are written to T2, not dropped: all 128 of A's blocks still read back exact."""
    args = small_args(tmp_path, "--set", "policy.t1_to_t2=off", "--set", "retention.max_tenant_share=1")
    other_layout = dataclasses.replace(LAYOUT, model_id="retention-other-model")
    with DaemonProcess(args) as daemon, KvtierClient(daemon.address) as client:
        chains = [chain(client, seed, 32) for seed in range(4)]
        for hashes, tokens in chains:
            put(client, hashes, tokens, pb.RetentionHint(retention_session="agent", priority=NORMAL, ttl_s=600))
        assert wait_until(lambda: usage(client).num_t1_blocks == 64)
        assert usage(client).num_t2_blocks == 0

        session = client.attach(other_layout, map_pool=False)
        for seed in range(100, 104):
            tokens = prompt(seed, 32 * LAYOUT.block_size)
            hashes = session.namespace.hash_blocks(tokens)
            size = LAYOUT.block_size
            client.put(other_layout, [(h, tokens[i * size:(i + 1) * size], expected_block(h, LAYOUT.bytes_per_block))
                                      for i, h in enumerate(hashes)])
        session.close()

        def t1_held_bytes() -> list[int]:
            return sorted(t.node_held_bytes for p in client.stats().pools for t in p.tiers if t.tier == "t1")

        assert wait_until(lambda: t1_held_bytes() == [128 * 1024, 128 * 1024], timeout_s=30), t1_held_bytes()
        assert wait_until(lambda: usage(client).num_t2_blocks >= 32, timeout_s=15), usage(client)
        for hashes, tokens in chains:
            assert exact(client, hashes, tokens)
