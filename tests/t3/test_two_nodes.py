"""Two daemons ("nodes": own sockets, pools, SSD directories) sharing one real Redis Cluster."""

from __future__ import annotations

import contextlib
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvtierd.client import KvtierClient
from kvtierd.launch.daemon_process import DaemonProcess, small_daemon_args, wait_until
from tests.server.e2e_runner import LAYOUT, expected_block, prompt
from tests.t3.redis_cluster import kill_node, owner_port

pytestmark = pytest.mark.timeout(180)
TOKENS = "acme a-token\nglobex g-token\n"


def node_args(directory, seeds: str, *extra: str) -> list[str]:
    """A small daemon on `seeds`, writing what it computes through to T1 and on to T3 at once."""
    return small_daemon_args(str(directory), extra=[
        "--tokens-file", str(directory.parent / "tokens"), "--set", f"remote.endpoints={seeds}",
        "--set", "policy.t0_to_t1=write_through", "--set", "remote.timeout_s=0.3",
        "--set", "remote.breaker_open_s=2", *extra])


@contextlib.contextmanager
def two_nodes(tmp_path, seeds: str, *extra: str):
    (tmp_path / "tokens").write_text(TOKENS)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with DaemonProcess(node_args(tmp_path / "a", seeds, *extra)) as a, \
            DaemonProcess(node_args(tmp_path / "b", seeds, *extra)) as b:
        yield a, b


def t3_stats(client: KvtierClient):
    pools = [p for p in client.stats().pools if p.layout.model_id == LAYOUT.model_id]
    return pools[0].t3 if pools else None


def put_chain(client: KvtierClient, seed: int, num_tokens: int):
    """Put a chain through `client`; wait until the shared store took every block."""
    tokens = prompt(seed, num_tokens)
    hashes = client.attach(LAYOUT).namespace.hash_blocks(tokens)
    blocks = [(h, tokens[4 * i:4 * i + 4], expected_block(h, LAYOUT.bytes_per_block)) for i, h in enumerate(hashes)]
    before = t3_stats(client).num_written_blocks if t3_stats(client) else 0
    assert client.put(LAYOUT, blocks).num_blocks == len(blocks)
    assert wait_until(lambda: t3_stats(client).num_written_blocks >= before + len(blocks), timeout_s=20)
    return tokens, hashes


def test_a_prefix_put_through_node_a_is_a_t3_hit_on_node_b_with_its_bytes(tmp_path, redis_cluster):
    """Node B has nothing locally; Lookup finds the chain in T3 and Get returns node A's bytes."""
    with two_nodes(tmp_path, redis_cluster.seeds) as (a, b), \
            KvtierClient(a.address, token="a-token") as on_a, KvtierClient(b.address, token="a-token") as on_b:
        tokens, hashes = put_chain(on_a, 1, 64)
        lookup = on_b.attach(LAYOUT).lookup(hashes, token_ids=tokens)
        assert tuple(lookup.total) == (0, 0, 0, 16)
        got = on_b.get(LAYOUT, hashes, token_ids=tokens)
        assert [h for h, _ in got] == hashes
        assert all(data == expected_block(h, LAYOUT.bytes_per_block) for h, data in got)
        t3 = t3_stats(on_b)
        assert (t3.num_hit_blocks, t3.num_corrupt_blocks) == (16, 0)
        hit_tiers = {t.tier: t.num_hit_blocks for p in on_b.stats().pools for t in p.tiers}
        assert hit_tiers["t0"] == 0  # every block came from the shared store


def test_several_chains_in_one_lookup_on_node_b_are_each_found_in_t3(tmp_path, redis_cluster):
    """chain_lengths on a node whose tiers are empty: every chain's part comes from the store's probe."""
    with two_nodes(tmp_path, redis_cluster.seeds) as (a, b), \
            KvtierClient(a.address, token="a-token") as on_a, KvtierClient(b.address, token="a-token") as on_b:
        tokens, hashes = put_chain(on_a, 2, 64)
        absent = on_b.attach(LAYOUT).namespace.hash_blocks(prompt(3, 4))
        lookup = on_b.attach(LAYOUT).lookup(hashes[:5] + hashes[9:] + hashes[7:8] + absent, chain_lengths=[5, 7, 1, 1])
        assert [(c.t0, c.t3) for c in lookup.hits] == [(0, 5), (0, 7), (0, 1), (0, 0)]
        assert lookup.total.t3 == 13


def test_another_tenant_misses_on_every_node(tmp_path, redis_cluster):
    """The tenant's tag is in every key: globex asking for acme's chain gets nothing, on A or B."""
    with two_nodes(tmp_path, redis_cluster.seeds) as (a, b), \
            KvtierClient(a.address, token="a-token") as acme, KvtierClient(b.address, token="g-token") as globex_b, \
            KvtierClient(a.address, token="g-token") as globex_a:
        tokens, hashes = put_chain(acme, 2, 32)
        for globex in (globex_a, globex_b):
            assert globex.attach(LAYOUT).lookup(hashes, token_ids=tokens).total.num_blocks == 0
            assert globex.get(LAYOUT, hashes, token_ids=tokens) == []


def test_a_value_overwritten_in_the_store_is_a_miss_and_counted(tmp_path, redis_cluster):
    """Another writer's bytes under a block's key: the chain ends before it, the refusal is counted."""
    with two_nodes(tmp_path, redis_cluster.seeds) as (a, b), \
            KvtierClient(a.address, token="a-token") as on_a, KvtierClient(b.address, token="a-token") as on_b:
        tokens, hashes = put_chain(on_a, 3, 32)
        client_hash_hex = hashes[5].hex()
        keys = [key for port in redis_cluster.ports
                for key in redis_cluster.node_client(port).scan_iter(match=f"*:{client_hash_hex}")]
        assert len(keys) == 1
        with contextlib.closing(redis_cluster.node_client(owner_port(redis_cluster, keys[0]))) as node:
            value = node.get(keys[0])
            node.set(keys[0], value[:-1] + bytes([value[-1] ^ 0xFF]))  # one byte of the block flipped
        got = on_b.get(LAYOUT, hashes, token_ids=tokens)
        assert [h for h, _ in got] == hashes[:5]
        assert all(data == expected_block(h, LAYOUT.bytes_per_block) for h, data in got)
        assert t3_stats(on_b).num_corrupt_blocks == 1


def test_a_killed_store_node_gives_misses_for_its_slots_and_exact_bytes_for_the_rest(tmp_path, redis_cluster):
    """Single-block chains spread over the 3 masters; one master killed: its blocks are misses,
    every other block comes back exactly, and the node's breaker opens (stats say so)."""
    with two_nodes(tmp_path, redis_cluster.seeds) as (a, b), \
            KvtierClient(a.address, token="a-token") as on_a, KvtierClient(b.address, token="a-token") as on_b:
        chains = [put_chain(on_a, 100 + i, 4) for i in range(24)]
        key_of = {}
        for port in redis_cluster.ports:
            with contextlib.closing(redis_cluster.node_client(port)) as node:
                for key in node.scan_iter(match="kvtierd:*"):
                    key_of[key.decode().rsplit(":", 1)[1]] = port
        victim = redis_cluster.ports[1]
        on_victim = {i for i, (_, hashes) in enumerate(chains) if key_of[hashes[0].hex()] == victim}
        assert 0 < len(on_victim) < len(chains)
        kill_node(redis_cluster, victim)
        for i, (tokens, hashes) in enumerate(chains):
            got = on_b.get(LAYOUT, hashes, token_ids=tokens)
            if i in on_victim:
                assert got == []
            else:
                assert got == [(hashes[0], expected_block(hashes[0], LAYOUT.bytes_per_block))]
        remote = on_b.stats().remote
        assert remote.enabled and remote.num_open_nodes == 1 and remote.breaker_state == "open"


def test_a_daemon_whose_store_is_unreachable_starts_and_serves(tmp_path):
    """No store at the endpoints: the daemon starts, Put and Get work from its own tiers, and
    kvtierctl health reports the shared store as a problem (exit 1)."""
    import socket
    import subprocess
    import sys

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{probe.getsockname()[1]}"  # nothing listens once closed
    (tmp_path / "tokens").write_text(TOKENS)
    (tmp_path / "a").mkdir()
    with DaemonProcess(node_args(tmp_path / "a", dead)) as a, KvtierClient(a.address, token="a-token") as client:
        tokens = prompt(4, 16)
        hashes = client.attach(LAYOUT).namespace.hash_blocks(tokens)
        blocks = [(h, tokens[4 * i:4 * i + 4], expected_block(h, LAYOUT.bytes_per_block)) for i, h in enumerate(hashes)]
        assert client.put(LAYOUT, blocks).num_blocks == 4
        assert client.get(LAYOUT, hashes, token_ids=tokens) == [(h, d) for h, _, d in blocks]
        health = subprocess.run([sys.executable, "-m", "kvtierd.cli.kvtierctl", "--address", a.address,
                                 "--token", "a-token", "health"], capture_output=True, text=True, timeout=60)
        assert health.returncode == 1, health.stdout + health.stderr
        assert "shared store (T3) unreachable" in health.stdout


def t3_miss_metric(daemon: DaemonProcess) -> tuple[float, float]:
    """(kvtierd_t3_hit_blocks_total, kvtierd_t3_miss_blocks_total) of LAYOUT in a scrape of `daemon`."""
    text = urllib.request.urlopen(daemon.metrics_url, timeout=10).read().decode()
    found = {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
             if s.labels.get("model") == LAYOUT.model_id}
    return found["kvtierd_t3_hit_blocks_total"], found["kvtierd_t3_miss_blocks_total"]


def test_t3_misses_count_every_block_of_a_query_the_store_did_not_supply_once(tmp_path, redis_cluster):
    """Node B asks for blocks never stored and blocks behind a killed master: each block of a query
    is one hit or one miss (Lookup with num_query_blocks, Acquire, Get), never two (a Get's probe and
    its load; a Lookup and the Acquire of its hits); a Lookup that is no query and a store's Acquire
    count none."""
    with two_nodes(tmp_path, redis_cluster.seeds) as (a, b), \
            KvtierClient(a.address, token="a-token") as on_a, KvtierClient(b.address, token="a-token") as on_b:
        session = on_b.attach(LAYOUT)
        stored_tokens, stored = put_chain(on_a, 11, 64)  # 16 blocks in the store
        got = on_b.get(LAYOUT, session.namespace.hash_blocks(prompt(11, 80)), token_ids=prompt(11, 80))
        assert [h for h, _ in got] == stored  # + 4 blocks never stored: 4 misses
        looked_tokens, looked = put_chain(on_a, 12, 40)  # 10 blocks in the store
        lookup = session.lookup(session.namespace.hash_blocks(prompt(12, 52)), token_ids=prompt(12, 52),
                                num_query_blocks=13)
        assert lookup.total.t3 == 10  # + 3 never stored: 3 misses
        acquired = session.acquire("load", looked, token_ids=looked_tokens, query_counted=True)
        assert session.wait("load") == 10 and acquired.num_t3_blocks == 10
        session.release("load")
        assert session.lookup(session.namespace.hash_blocks(prompt(13, 24))).total.num_blocks == 0  # no query
        session.acquire("plain", session.namespace.hash_blocks(prompt(14, 20)), token_ids=prompt(14, 20))
        session.release("plain")  # 5 misses
        session.acquire("store", session.namespace.hash_blocks(prompt(15, 28)), token_ids=prompt(15, 28),
                        for_store=True)
        session.release("store")  # none
        assert (t3_stats(on_b).num_hit_blocks, t3_stats(on_b).num_miss_blocks) == (16 + 10, 4 + 3 + 5)

        dead_tokens, dead = put_chain(on_a, 16, 48)  # 12 blocks, from the j-th on a master about to die
        port_of = {}
        for port in redis_cluster.ports:
            with contextlib.closing(redis_cluster.node_client(port)) as node:
                port_of.update({key.decode().rsplit(":", 1)[1]: port for key in node.scan_iter(match="kvtierd:*")})
        owners = [port_of[h.hex()] for h in dead]  # a key ends in its client hash
        j = next(i for i, port in enumerate(owners) if port != owners[0])
        kill_node(redis_cluster, owners[j])
        assert [h for h, _ in on_b.get(LAYOUT, dead, token_ids=dead_tokens)] == dead[:j]
        want = (16 + 10 + j, 4 + 3 + 5 + 12 - j)
        t3 = t3_stats(on_b)
        assert (t3.num_hit_blocks, t3.num_miss_blocks) == want
        assert t3_miss_metric(b) == want


# ------------------------------------------------------------------------------------------------ Get streamed from T3


def delete_value(cluster, client_hash: bytes) -> None:
    """Remove one block's value from the store (as an eviction would)."""
    keys = [key for port in cluster.ports
            for key in cluster.node_client(port).scan_iter(match=f"*:{client_hash.hex()}")]
    assert len(keys) == 1
    with contextlib.closing(cluster.node_client(owner_port(cluster, keys[0]))) as node:
        assert node.delete(keys[0]) == 1


def test_a_get_from_t3_returns_the_chain_and_lands_it_in_node_bs_t1(tmp_path, redis_cluster):
    """A 40-block chain only in T3, streamed to the client chunk by chunk: every block exact, 40 T3 hits,
    and node B's T1 holds the chain afterwards (a Lookup finds it there, no longer in T3)."""
    with two_nodes(tmp_path, redis_cluster.seeds) as (a, b), \
            KvtierClient(a.address, token="a-token") as on_a, KvtierClient(b.address, token="a-token") as on_b:
        tokens, hashes = put_chain(on_a, 21, 160)
        got = on_b.get(LAYOUT, hashes, token_ids=tokens)
        assert [h for h, _ in got] == hashes
        assert all(data == expected_block(h, LAYOUT.bytes_per_block) for h, data in got)
        assert (t3_stats(on_b).num_hit_blocks, t3_stats(on_b).num_miss_blocks) == (40, 0)
        session = on_b.attach(LAYOUT)
        assert wait_until(lambda: session.lookup(hashes, token_ids=tokens).total.t1 == 40, timeout_s=20)


def test_a_get_whose_eleventh_value_is_gone_returns_the_ten_before_it_and_counts_the_rest_once(
        tmp_path, redis_cluster):
    """Block 11 of 40 evicted from the store: the probe (first and last key) claims 40, the Get returns
    blocks 1-10 exactly; 10 hits and 30 misses, though the chunks after it were read ahead."""
    with two_nodes(tmp_path, redis_cluster.seeds) as (a, b), \
            KvtierClient(a.address, token="a-token") as on_a, KvtierClient(b.address, token="a-token") as on_b:
        tokens, hashes = put_chain(on_a, 22, 160)
        delete_value(redis_cluster, hashes[10])
        assert on_b.attach(LAYOUT).lookup(hashes, token_ids=tokens).total.t3 == 40
        got = on_b.get(LAYOUT, hashes, token_ids=tokens)
        assert [h for h, _ in got] == hashes[:10]
        assert all(data == expected_block(h, LAYOUT.bytes_per_block) for h, data in got)
        t3 = t3_stats(on_b)
        assert (t3.num_hit_blocks, t3.num_miss_blocks, t3.num_corrupt_blocks) == (10, 30, 0)


def test_a_get_of_a_chain_node_b_holds_in_part_returns_its_blocks_then_t3s(tmp_path, redis_cluster):
    """Node B put the chain's first 12 blocks itself; the other 20 only node A put: one Get returns all
    32 exactly, 12 from node B's T0 and 20 from T3."""
    with two_nodes(tmp_path, redis_cluster.seeds) as (a, b), \
            KvtierClient(a.address, token="a-token") as on_a, KvtierClient(b.address, token="a-token") as on_b:
        tokens, hashes = put_chain(on_a, 23, 128)
        put_chain(on_b, 23, 48)
        before = {t.tier: t.num_hit_blocks for p in on_b.stats().pools for t in p.tiers}
        got = on_b.get(LAYOUT, hashes, token_ids=tokens)
        assert [h for h, _ in got] == hashes
        assert all(data == expected_block(h, LAYOUT.bytes_per_block) for h, data in got)
        after = {t.tier: t.num_hit_blocks for p in on_b.stats().pools for t in p.tiers}
        assert after["t0"] - before["t0"] == 12
        assert t3_stats(on_b).num_hit_blocks == 20
