"""A Lookup's promise held until its Acquire, against a real `kvtierd serve`: a flood of other
requests' stores between the two cannot evict the promised blocks; holds are bounded, and a bad
hold_id is refused and changes nothing."""

from __future__ import annotations

import pytest

from kvtierd.client import KvtierClient
from kvtierd.errors import InvalidArgument
from kvtierd.launch.daemon_process import DaemonProcess
from tests.server.e2e_runner import LAYOUT
from tests.server.test_retention_daemon import chain, exact, flood, put, small_args, where

T1_OFF = ("--set", "policy.t1_to_t2=off")


def test_a_held_promise_survives_a_flood_and_its_acquire_loads_it_all(tmp_path):
    """Chains A and B (8 blocks each) in T0; A looked up with a hold_id, B without; 160 blocks of
    other Puts through T0 64 + T1 64: B is gone, A's Acquire naming the hold finds its 8 blocks in T0,
    and once that request is released they read back exactly."""
    with DaemonProcess(small_args(tmp_path, *T1_OFF)) as daemon, KvtierClient(daemon.address) as client:
        (a, a_tokens), (b, b_tokens) = chain(client, 1, 8), chain(client, 2, 8)
        put(client, a, a_tokens)
        put(client, b, b_tokens)
        with client.attach(LAYOUT, map_pool=False) as session:
            assert session.lookup(a, token_ids=a_tokens, hold_id="req-a").total.t0 == 8
            assert session.lookup(b, token_ids=b_tokens).total.t0 == 8
            flood(client, 100)
            assert where(client, b, b_tokens).total.num_blocks == 0
            acquired = session.acquire("load-a", a, token_ids=a_tokens, query_counted=True, load_every_hit=True,
                                       hold_id="req-a")
            assert acquired.num_t0_hit_blocks == 8
            session.release("load-a")
        assert exact(client, a, a_tokens)


def test_holds_take_at_most_a_quarter_of_t0_and_a_second_lookup_replaces_the_first(tmp_path):
    """T0 of 64 blocks: a hold of a 24-block chain holds its first 16; looked up again under the same
    hold_id, the pool still holds 16 (replaced, not added); after a flood 16 are left in T0."""
    with DaemonProcess(small_args(tmp_path, *T1_OFF)) as daemon, KvtierClient(daemon.address) as client:
        long_chain, tokens = chain(client, 3, 24)
        put(client, long_chain, tokens)
        with client.attach(LAYOUT, map_pool=False) as session:
            assert session.lookup(long_chain, token_ids=tokens, hold_id="req-long").total.t0 == 24
            assert session.lookup(long_chain, token_ids=tokens, hold_id="req-long").total.t0 == 24
            flood(client, 100)
            assert where(client, long_chain, tokens).total.t0 == 16


def test_a_hold_id_past_256_characters_is_refused_and_holds_nothing(tmp_path):
    with DaemonProcess(small_args(tmp_path, *T1_OFF)) as daemon, KvtierClient(daemon.address) as client:
        a, a_tokens = chain(client, 1, 8)
        put(client, a, a_tokens)
        with client.attach(LAYOUT, map_pool=False) as session:
            with pytest.raises(InvalidArgument, match="hold_id must be at most 256 characters"):
                session.lookup(a, token_ids=a_tokens, hold_id="x" * 257)
            with pytest.raises(InvalidArgument, match="hold_id"):
                session.acquire("r", a, token_ids=a_tokens, hold_id="x" * 257)
            flood(client, 100)
            assert where(client, a, a_tokens).total.num_blocks == 0  # nothing was held
