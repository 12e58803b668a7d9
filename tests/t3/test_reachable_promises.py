"""A Lookup promises only the T3 blocks on store nodes the daemon knows reachable: on a 3-master
cluster with a master killed, a chain whose first and last blocks live on the others and some
blocks between on the dead one is promised up to its first block there, and Get and a promotion
return exactly that. A node not yet known dead (no call reached it since it died) is found by the
load that follows, and promised nothing after."""

from __future__ import annotations

import contextlib

import pytest

from kvtierd.client import KvtierClient
from kvtierd.launch.daemon_process import wait_until
from tests.server.e2e_runner import LAYOUT, expected_block
from tests.t3.redis_cluster import kill_node
from tests.t3.test_two_nodes import put_chain, t3_stats, two_nodes

pytestmark = pytest.mark.timeout(180)
NUM_CHAINS = 16  # 4-block chains put through node A, so that some have blocks between on each master


def owners_of(cluster, hashes: list[bytes]) -> list[int]:
    """The port of the master holding each block's value (a key ends in its client hash)."""
    port_of = {}
    for port in cluster.ports:
        with contextlib.closing(cluster.node_client(port)) as node:
            port_of.update({key.decode().rsplit(":", 1)[1]: port for key in node.scan_iter(match="kvtierd:*")})
    return [port_of[h.hex()] for h in hashes]


def chains_with_a_gap_on(cluster, chains, victim: int) -> list[tuple[list[int], list[bytes], int]]:
    """(tokens, hashes, j) of each chain whose first and last blocks are not on `victim` and whose
    j-th block (the first there) is."""
    found = []
    for tokens, hashes in chains:
        owners = owners_of(cluster, hashes)
        if owners[0] != victim and owners[-1] != victim and victim in owners:
            found.append((tokens, hashes, owners.index(victim)))
    return found


def put_chains_and_pick_a_victim(cluster, on_a: KvtierClient):
    """Put NUM_CHAINS chains through node A; the master between whose chains' ends most blocks lie, and those chains."""
    chains = [put_chain(on_a, 300 + i, 16) for i in range(NUM_CHAINS)]
    victim = max(cluster.ports, key=lambda port: len(chains_with_a_gap_on(cluster, chains, port)))
    gapped = chains_with_a_gap_on(cluster, chains, victim)
    assert len(gapped) >= 2, "the chains put have no gap on any master"
    return victim, gapped


def test_a_lookup_promises_up_to_a_known_dead_master_and_get_and_promotion_return_that(tmp_path, redis_cluster):
    """After node B's probe found the master dead: Lookup = j T3 hits (not all 4), the
    Acquire that follows promotes j, the Get returns those j blocks exactly (now from node B's own
    tiers); the Lookup's query and the Get's each count the 4 - j blocks behind the dead master
    once as T3 misses, the promoted j as T3 hits."""
    with two_nodes(tmp_path, redis_cluster.seeds) as (a, b), \
            KvtierClient(a.address, token="a-token") as on_a, KvtierClient(b.address, token="a-token") as on_b:
        victim, gapped = put_chains_and_pick_a_victim(redis_cluster, on_a)
        tokens, hashes, j = gapped[0]
        session = on_b.attach(LAYOUT)
        kill_node(redis_cluster, victim)
        assert wait_until(lambda: on_b.stats().remote.num_open_nodes == 1, timeout_s=30)  # its PINGs found it

        lookup = session.lookup(hashes, token_ids=tokens, num_query_blocks=len(hashes))
        assert (lookup.total.num_blocks, lookup.total.t3) == (j, j)
        acquired = session.acquire("load", hashes, token_ids=tokens, query_counted=True, load_every_hit=True)
        assert acquired.num_t3_blocks == j and session.wait("load") == j
        session.release("load")
        got = on_b.get(LAYOUT, hashes, token_ids=tokens)
        assert [h for h, _ in got] == hashes[:j]
        assert all(data == expected_block(h, LAYOUT.bytes_per_block) for h, data in got)
        t3 = t3_stats(on_b)
        assert (t3.num_hit_blocks, t3.num_miss_blocks) == (j, 2 * (len(hashes) - j))


def test_a_master_not_yet_known_dead_is_promised_once_then_found_by_the_load(tmp_path, redis_cluster):
    """Node B never PINGs on its own (probe_interval_s 3600): the first Lookup after the kill asks
    only the chain's first and last keys, on live masters, and promises all 4 (not known yet); the
    promotion's load reaches the dead master and brings j; a Lookup of another such chain then
    promises only up to its first block there."""
    with two_nodes(tmp_path, redis_cluster.seeds, "--set", "remote.probe_interval_s=3600") as (a, b), \
            KvtierClient(a.address, token="a-token") as on_a, KvtierClient(b.address, token="a-token") as on_b:
        victim, gapped = put_chains_and_pick_a_victim(redis_cluster, on_a)
        session = on_b.attach(LAYOUT)
        kill_node(redis_cluster, victim)

        tokens, hashes, j = gapped[0]
        assert session.lookup(hashes, token_ids=tokens).total.t3 == len(hashes)
        assert on_b.stats().remote.num_open_nodes == 0
        session.acquire("load", hashes, token_ids=tokens, load_every_hit=True)
        assert session.wait("load") == j
        session.release("load")
        assert on_b.stats().remote.num_open_nodes == 1

        tokens, hashes, j = gapped[1]
        assert session.lookup(hashes, token_ids=tokens).total.t3 == j
        assert [h for h, _ in on_b.get(LAYOUT, hashes, token_ids=tokens)] == hashes[:j]
