"""One layout's T3 on a real Redis: what is offered and drained loads back exactly (bytes, token ids,
parents); keys carry the key prefix, the layout digest and the tenant tag, so other layouts, codecs,
tenants and prefixes never read each other's values; a chain is read up to its first missing or
refused value."""

from __future__ import annotations

import contextlib
import socket
import struct

import pytest
import torch

from kvtierd.index.slot_entry import BlockMeta
from kvtierd.layout import Layout
from kvtierd.movers.block_codec import make_codec
from kvtierd.t3.block_frame import layout_digest
from kvtierd.t3.redis_store import RedisStore
from kvtierd.t3.remote_config import RemoteConfig
from kvtierd.t3.remote_tier import RemoteTier

pytestmark = pytest.mark.timeout(120)
LAYOUT = Layout("m", 2, 2, 16, 4)
SLOT_NBYTES = make_codec("raw", LAYOUT).slot_nbytes  # 1024
ACME = bytes(range(16))  # tenant tags (TAG_BYTES)
GLOBEX = bytes(range(100, 116))
ROOT = b"\0" * 48


def chain(tag: bytes, seed: int, length: int) -> list[BlockMeta]:
    """A chain of `length` blocks of one tenant: daemon keys (tag + 32-byte client hash), parents, tokens."""
    metas, parent = [], ROOT
    for i in range(length):
        block_hash = tag + struct.pack("<QQ", seed, i) + bytes(16)
        tokens = struct.pack("<4I", *(seed * 1000 + 4 * i + j for j in range(4)))
        metas.append(BlockMeta(block_hash, parent, tokens))
        parent = block_hash
    return metas


def rows_for(metas: list[BlockMeta], nbytes: int = SLOT_NBYTES) -> torch.Tensor:
    """Slot rows whose bytes differ per block (from its hash)."""
    rows = torch.empty((len(metas), nbytes), dtype=torch.uint8)
    for i, meta in enumerate(metas):
        seed = int.from_bytes(meta.block_hash[16:24], "little") * 31 + meta.block_hash[24]
        rows[i] = (torch.arange(nbytes) * 7 + seed) % 256
    return rows


def hashes(metas) -> list[bytes]:
    return [m.block_hash for m in metas]


def tokens_of(metas) -> bytes:
    return b"".join(m.token_ids for m in metas)


class Stores:
    """RedisStores on one deployment (closed at the end) and RemoteTiers on them."""

    def __init__(self, deployment) -> None:
        self.deployment = deployment
        self._close = contextlib.ExitStack()

    def tier(self, layout: Layout = LAYOUT, codec: str = "raw", **fields) -> RemoteTier:
        endpoints = tuple((self.deployment.host, port) for port in self.deployment.ports)
        store = RedisStore(RemoteConfig(endpoints, timeout_s=1.0, **fields))
        tier = RemoteTier(store, layout, codec, make_codec(codec, layout).slot_nbytes)
        self._close.callback(store.close)
        self._close.callback(tier.close)  # runs first: its writer uses the store
        return tier

    def client(self):
        if self.deployment.cluster:
            return contextlib.closing(self.deployment.cluster_client())
        return contextlib.closing(self.deployment.node_client(self.deployment.ports[0]))

    def close(self) -> None:
        self._close.close()


@pytest.fixture
def stores(redis_single):
    stores = Stores(redis_single)
    yield stores
    stores.close()


@pytest.fixture
def cluster_stores(redis_cluster_module):
    stores = Stores(redis_cluster_module)
    yield stores
    stores.close()
    for port in redis_cluster_module.ports:
        with contextlib.closing(redis_cluster_module.node_client(port)) as node:
            node.flushall()


def written(tier: RemoteTier, metas: list[BlockMeta], rows: torch.Tensor | None = None) -> torch.Tensor:
    """Offer the blocks and wait until the store took every one; their rows."""
    rows = rows_for(metas) if rows is None else rows
    before = tier.stats().num_written_blocks
    assert tier.offer(metas, rows) == len(metas)
    assert tier.drain(10)
    assert tier.stats().num_written_blocks == before + len(metas)
    return rows


def assert_loaded(loaded, metas: list[BlockMeta], rows: torch.Tensor) -> None:
    got_metas, payloads = loaded
    assert got_metas == metas[:len(got_metas)]
    for payload, row in zip(payloads, rows):
        assert bytes(payload) == row.numpy().tobytes()


# ------------------------------------------------------------------------------------------------ round trip


@pytest.mark.cluster  # its store fixture is picked by getfixturevalue, which the lanes cannot see
@pytest.mark.parametrize("deployment", ["single", "cluster"])
def test_offered_blocks_load_back_with_their_exact_bytes_token_ids_and_parents(request, deployment):
    """offer + drain, then load: every block, in order, with the bytes offered and the metas written
    (token ids from the frames when the caller sends none); the tier's counters say so."""
    stores = request.getfixturevalue("stores" if deployment == "single" else "cluster_stores")
    tier = stores.tier()
    metas = chain(ACME, 1, 12)
    rows = written(tier, metas)
    for token_bytes in (tokens_of(metas), None):
        loaded = tier.load(hashes(metas), ROOT, token_bytes, LAYOUT.block_size)
        assert len(loaded[0]) == 12
        assert_loaded(loaded, metas, rows)
    got_metas, _ = tier.load(hashes(metas), None, None, LAYOUT.block_size)  # parent from the frame
    assert got_metas == metas
    stats = tier.stats()
    assert (stats.num_hit_blocks, stats.num_miss_blocks, stats.num_corrupt_blocks) == (36, 0, 0)
    assert stats.written_bytes == stats.read_bytes // 3 and stats.write_backlog_bytes == 0


def test_a_second_tier_on_another_store_client_reads_what_the_first_wrote(stores):
    """Another daemon (its own RedisStore and RemoteTier, same layout and codec) sees the blocks."""
    metas = chain(ACME, 2, 5)
    rows = written(stores.tier(), metas)
    assert_loaded(stores.tier().load(hashes(metas), ROOT, tokens_of(metas), LAYOUT.block_size), metas, rows)


def test_rows_reused_after_offer_do_not_change_what_is_written(stores):
    """offer copies: the caller overwriting its rows at once does not change the stored values."""
    tier = stores.tier()
    metas = chain(ACME, 3, 4)
    rows = rows_for(metas)
    original = rows.clone()
    assert tier.offer(metas, rows) == 4
    rows.fill_(0)
    assert tier.drain(10)
    assert_loaded(tier.load(hashes(metas), ROOT, None, LAYOUT.block_size), metas, original)


def test_keys_hold_the_prefix_the_layout_digest_the_tenant_tag_and_the_client_hash(stores):
    """Each block is one key <prefix>:<layout digest hex>:<tenant tag hex>:<client hash hex>, nothing else."""
    tier = stores.tier(key_prefix="kvt")
    metas = chain(ACME, 4, 3)
    written(tier, metas)
    digest = layout_digest(LAYOUT, "raw").hex()
    expected = {f"kvt:{digest}:{ACME.hex()}:{m.block_hash[16:].hex()}".encode() for m in metas}
    assert {tier.key(m.block_hash) for m in metas} == expected
    with stores.client() as client:
        assert set(client.keys("*")) == expected


def test_a_block_offered_again_is_not_written_again(stores):
    """Blocks written recently are skipped by offer (no second write of the same key)."""
    tier = stores.tier()
    metas = chain(ACME, 5, 4)
    written(tier, metas)
    assert tier.offer(metas, rows_for(metas)) == 0
    assert tier.offer(chain(ACME, 5, 6), rows_for(chain(ACME, 5, 6))) == 2
    assert tier.drain(10) and tier.stats().num_written_blocks == 6


# ------------------------------------------------------------------------------------------------ isolation


@pytest.mark.parametrize("other", [
    pytest.param(dict(layout=Layout("m2", 2, 2, 16, 4)), id="another-model"),
    pytest.param(dict(layout=Layout("m", 2, 2, 16, 4, tp_rank=1, tp_size=2)), id="another-tp-rank"),
    pytest.param(dict(codec="fp8"), id="another-codec"),
    pytest.param(dict(key_prefix="other"), id="another-key-prefix"),
])
def test_another_layout_codec_or_key_prefix_does_not_see_the_values(stores, other):
    """A tier of another layout (same block bytes), codec or key prefix: probe 0, load nothing, counted
    as misses, never as hits."""
    metas = chain(ACME, 6, 4)
    written(stores.tier(), metas)
    stranger = stores.tier(**other)
    assert stranger.probe(hashes(metas)) == 0
    assert stranger.load(hashes(metas), ROOT, tokens_of(metas), LAYOUT.block_size) == ([], [])
    stats = stranger.stats()
    assert (stats.num_hit_blocks, stats.num_miss_blocks) == (0, 4)


@pytest.mark.parametrize("codec", ["raw", "fp8"])
def test_a_value_of_another_layout_under_this_layouts_key_is_refused_as_layout(stores, codec):
    """Another layout's (or codec's) frame copied under our key (a misconfigured writer): a miss, counted
    as corrupt "layout"."""
    ours = stores.tier()
    theirs = stores.tier(layout=Layout("m2", 2, 2, 16, 4), codec=codec)
    metas = chain(ACME, 7, 3)
    written(theirs, metas, rows_for(metas, theirs.slot_nbytes))
    with stores.client() as client:
        for meta in metas[1:]:
            client.set(ours.key(meta.block_hash), client.get(theirs.key(meta.block_hash)))
    written(ours, metas[:1])
    got, _ = ours.load(hashes(metas), ROOT, tokens_of(metas), LAYOUT.block_size)
    assert got == metas[:1]
    assert ours.stats().corrupt_reasons == {"layout": 1} and ours.stats().num_miss_blocks == 2


def test_another_tenant_misses_the_same_client_hashes(stores):
    """Same client hashes under another tenant tag: other keys, so nothing is found."""
    tier = stores.tier()
    metas = chain(ACME, 8, 3)
    written(tier, metas)
    theirs = [GLOBEX + m.block_hash[16:] for m in metas]
    assert tier.probe(theirs) == 0
    assert tier.load(theirs, ROOT, None, LAYOUT.block_size) == ([], [])


# ------------------------------------------------------------------------------------------------ partial chains


@pytest.mark.cluster  # its store fixture is picked by getfixturevalue, which the lanes cannot see
@pytest.mark.parametrize("deployment", ["single", "cluster"])
def test_a_chain_whose_third_value_is_gone_loads_its_first_two(request, deployment):
    """Value 3 of 6 deleted (evicted by the store): the probe, which asks the first and last keys,
    takes all 6 as present; the load, which verifies every value, stops before it; 4 misses counted."""
    stores = request.getfixturevalue("stores" if deployment == "single" else "cluster_stores")
    tier = stores.tier()
    metas = chain(ACME, 9, 6)
    rows = written(tier, metas)
    with stores.client() as client:
        assert client.delete(tier.key(metas[2].block_hash)) == 1
    assert tier.probe(hashes(metas)) == 6
    loaded = tier.load(hashes(metas), ROOT, tokens_of(metas), LAYOUT.block_size)
    assert len(loaded[0]) == 2
    assert_loaded(loaded, metas, rows)
    assert (tier.stats().num_hit_blocks, tier.stats().num_miss_blocks, tier.stats().num_corrupt_blocks) == (2, 4, 0)


def test_probe_counts_the_leading_keys_present(stores):
    """probe is the length of the present prefix: all, none when the first is gone, 0 for no hashes."""
    tier = stores.tier()
    metas = chain(ACME, 10, 5)
    written(tier, metas[:3])
    assert tier.probe(hashes(metas)) == 3
    assert tier.probe(hashes(metas[:3])) == 3
    assert tier.probe(hashes(metas[1:])) == 2
    assert tier.probe([]) == 0
    with stores.client() as client:
        client.delete(tier.key(metas[0].block_hash))
    assert tier.probe(hashes(metas)) == 0


def test_a_chain_whose_last_value_is_gone_is_probed_exactly(stores):
    """First present, last absent: the keys between are asked, and the answer is the present run."""
    tier = stores.tier()
    metas = chain(ACME, 11, 7)
    written(tier, metas[:5])
    assert tier.probe(hashes(metas)) == 5
    with stores.client() as client:
        client.delete(tier.key(metas[2].block_hash))
    assert tier.probe(hashes(metas)) == 2
    assert tier.probe(hashes(metas[:2])) == 2 and tier.probe(hashes(metas[4:6])) == 1


def test_probe_asks_only_the_first_and_last_keys_when_both_are_present(stores):
    """A 64-block chain in the store: one probe sends 2 EXISTS (the server's command count says so)."""
    tier = stores.tier()
    metas = chain(ACME, 12, 64)
    written(tier, metas)
    with stores.client() as client:
        before = client.info("commandstats").get("cmdstat_exists", {}).get("calls", 0)
        assert tier.probe(hashes(metas)) == 64
        assert client.info("commandstats")["cmdstat_exists"]["calls"] - before == 2


def test_an_acquire_reuses_the_lookups_answer_for_the_same_chain_once(stores):
    """probe(reuse=True) right after a probe of the same chain asks the store nothing and gives the same
    answer, once; a chain that differs (shorter, longer) is asked again; misses are counted once."""
    tier = stores.tier()
    metas = chain(ACME, 13, 6)
    written(tier, metas[:4])
    with stores.client() as client:
        calls = lambda: client.info("commandstats").get("cmdstat_exists", {}).get("calls", 0)  # noqa: E731
        assert tier.probe(hashes(metas), count_misses=True) == 4
        before = calls()
        assert tier.probe(hashes(metas), count_misses=True, reuse=True) == 4
        assert calls() == before
        assert tier.stats().num_miss_blocks == 2  # the Lookup's, not again
        assert tier.probe(hashes(metas), reuse=True) == 4 and calls() > before  # taken once: asked again
        before = calls()
        assert tier.probe(hashes(metas[:5]), reuse=True) == 4 and calls() > before  # another chain


def test_probe_chains_answers_each_chain_as_probe_does(stores):
    """Several chains in one call: each one's present prefix, empty chains 0, the order kept."""
    tier = stores.tier()
    metas = chain(ACME, 20, 6)
    written(tier, metas[:4])
    chains = [hashes(metas), hashes(metas[4:]), [], hashes(metas[2:3]), hashes(metas[1:3])]
    assert tier.probe_chains(chains) == [4, 0, 0, 1, 2]
    assert tier.probe_chains(chains) == [tier.probe(c) for c in chains]
    assert tier.probe_chains([]) == []


def test_a_corrupted_value_ends_the_chain_is_counted_and_may_be_written_again(stores):
    """A flipped payload byte in block 2's value: load gives blocks 0-1, counts "checksum"; offering the
    block again rewrites it (it is no longer 'known') and the whole chain loads."""
    tier = stores.tier()
    metas = chain(ACME, 11, 4)
    rows = written(tier, metas)
    key = tier.key(metas[2].block_hash)
    with stores.client() as client:
        value = client.get(key)
        client.set(key, value[:-1] + bytes([value[-1] ^ 0x40]))
    assert len(tier.load(hashes(metas), ROOT, tokens_of(metas), LAYOUT.block_size)[0]) == 2
    assert tier.stats().corrupt_reasons == {"checksum": 1}
    assert tier.offer(metas, rows) == 1  # only the refused one
    assert tier.drain(10)
    assert_loaded(tier.load(hashes(metas), ROOT, tokens_of(metas), LAYOUT.block_size), metas, rows)


def test_the_wrong_parent_or_token_ids_load_nothing_and_are_counted(stores):
    """A caller whose chain has another parent or other token ids gets none of these values."""
    tier = stores.tier()
    metas = chain(ACME, 12, 3)
    written(tier, metas)
    other_tokens = tokens_of(chain(ACME, 13, 3))
    assert tier.load(hashes(metas), b"\x01" * 48, None, LAYOUT.block_size) == ([], [])
    assert tier.load(hashes(metas), ROOT, other_tokens, LAYOUT.block_size) == ([], [])
    assert tier.stats().corrupt_reasons == {"parent": 1, "tokens": 1}


# ------------------------------------------------------------------------------------------------ writes


def test_offers_beyond_the_write_backlog_are_dropped_and_counted(stores):
    """max_write_backlog_bytes of 2 frames: of 5 offered at once 2 are taken (and written), 3 dropped and
    counted, and a dropped block stays unknown (offered again later, it is taken)."""
    tier = stores.tier(max_write_backlog_bytes=2 * (SLOT_NBYTES + 200))  # a frame: 1024 + 156 bytes
    metas = chain(ACME, 14, 5)
    assert tier.offer(metas, rows_for(metas)) == 2
    assert tier.stats().num_dropped_writes == 3
    assert tier.drain(10) and tier.stats().num_written_blocks == 2 and tier.stats().write_backlog_bytes == 0
    assert tier.probe(hashes(metas)) == 2
    assert tier.offer(metas, rows_for(metas)) == 2 and tier.drain(10) and tier.probe(hashes(metas)) == 4


def test_a_store_that_is_down_fails_writes_and_misses_reads_without_raising():
    """Nothing at the endpoint: offers are queued then counted as failed writes; probe and load are misses."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    store = RedisStore(RemoteConfig((("127.0.0.1", port),), timeout_s=0.2))
    tier = RemoteTier(store, LAYOUT, "raw", SLOT_NBYTES)
    try:
        metas = chain(ACME, 15, 3)
        assert tier.offer(metas, rows_for(metas)) == 3
        assert tier.drain(10)
        assert (tier.stats().num_written_blocks, tier.stats().num_failed_writes) == (0, 3)
        assert tier.probe(hashes(metas)) == 0
        assert tier.load(hashes(metas), ROOT, None, LAYOUT.block_size) == ([], [])
        assert tier.offer(metas, rows_for(metas)) == 3  # not 'known': offered again later
    finally:
        tier.close()
        store.close()
