"""Lookup of several chains in one call (`chain_lengths`), against a real `kvtierd serve`: each
chain is matched on its own, from its own first block, and its hits come back in order."""

from __future__ import annotations

import pytest

from kvtierd.client import KvtierClient
from kvtierd.launch.daemon_process import DaemonProcess, small_daemon_args
from kvtierd.layout import Layout

LAYOUT = Layout("chains", 2, 2, 16, 4)
TOKENS = list(range(500, 532))  # 8 blocks of 4


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    """A session whose pool holds TOKENS' 8-block chain in T0."""
    with DaemonProcess(small_daemon_args(str(tmp_path_factory.mktemp("daemon")))) as daemon, \
            KvtierClient(daemon.address) as client:
        session = client.attach(LAYOUT)
        hashes = session.namespace.hash_blocks(TOKENS)
        acquired = session.acquire("store", hashes, token_ids=TOKENS)
        session.commit("store", acquired.block_ids, hashes, TOKENS, None)
        session.release("store")
        yield session


def hits(response) -> list[tuple[int, int]]:
    return [(chain.num_blocks, chain.t0) for chain in response.hits]


def test_each_chain_is_matched_on_its_own_from_its_own_first_block(session):
    """[0..3) leads, [5..8) starts mid-chain, then one held block alone and one absent one."""
    hashes = session.namespace.hash_blocks(TOKENS)
    absent = session.namespace.hash_blocks(list(range(900, 904)))
    chains = hashes[0:3] + hashes[5:8] + hashes[2:3] + absent
    tokens = TOKENS[0:12] + TOKENS[20:32] + TOKENS[8:12] + list(range(900, 904))
    response = session.lookup(chains, token_ids=tokens, chain_lengths=[3, 3, 1, 1])
    assert hits(response) == [(3, 3), (3, 3), (1, 1), (0, 0)]
    assert (response.total.num_blocks, response.total.t0) == (7, 7)  # summed over the chains


def test_a_chain_breaks_at_its_first_miss_and_the_others_go_on(session):
    """A chain whose third block is unknown holds 2; the next chain is unaffected."""
    hashes = session.namespace.hash_blocks(TOKENS)
    absent = session.namespace.hash_blocks(list(range(900, 904)))[0]
    response = session.lookup(hashes[:2] + [absent] + hashes[3:4] + hashes[:4], chain_lengths=[4, 4])
    assert hits(response) == [(2, 2), (4, 4)]


def test_each_chain_is_verified_against_its_own_tokens(session):
    """The same block under its own tokens is a hit; under another block's tokens a miss."""
    hashes = session.namespace.hash_blocks(TOKENS)
    response = session.lookup([hashes[4], hashes[4]], token_ids=TOKENS[16:20] + TOKENS[0:4], chain_lengths=[1, 1])
    assert hits(response) == [(1, 1), (0, 0)]


def test_without_chain_lengths_all_the_hashes_are_one_chain(session):
    """The same hashes as two chains of 4 hold 4 + 4; as one chain (no lengths) they stop at the seam."""
    hashes = session.namespace.hash_blocks(TOKENS)
    twice = hashes[:4] + hashes[:4]
    assert hits(session.lookup(twice, chain_lengths=[4, 4])) == [(4, 4), (4, 4)]
    response = session.lookup(twice)
    assert [hits.num_blocks for hits in response.hits] == [4]
