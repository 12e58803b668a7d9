"""T0 ↔ T1 ↔ T3 through the tier manager on a real redis-server: what one manager writes through (or
on T1's eviction, or from T2) another one acquires with the exact bytes, landing in its T1 too; each
edge's policy decides what reaches the store; a store that is down costs a miss, fast, and nothing
local."""

from __future__ import annotations

import contextlib
import socket
import threading

import pytest

from kvtierd.t2.ssd_tier import SsdTierConfig
from kvtierd.t3.redis_store import RedisStore
from kvtierd.t3.remote_config import RemoteConfig
from kvtierd.tiering.tier_config import EdgePolicy, TierConfig
from kvtierd.tiering.tier_manager import TierManager
from tests.factories import BLOCK_SIZE, NAMESPACE, tokens
from tests.tiering.tier_factories import LAYOUT, assert_holds, prefill, promote_exactly

pytestmark = pytest.mark.timeout(120)
PROMPT = tokens(100, 4 * BLOCK_SIZE)
CHAIN = NAMESPACE.hash_blocks(PROMPT)
TIMEOUT_S = 0.2


class Nodes:
    """TierManagers ("nodes") with T3 on one store (a RedisStore each, as separate daemons), all closed."""

    def __init__(self, endpoints) -> None:
        self.endpoints = endpoints
        self._close = contextlib.ExitStack()

    def manager(self, host_blocks: int = 32, ssd_config=None, **config) -> TierManager:
        store = RedisStore(RemoteConfig(self.endpoints, timeout_s=TIMEOUT_S, breaker_open_s=60))
        self._close.callback(store.close)
        config.setdefault("host_capacity_bytes", host_blocks * 4096)
        manager = TierManager(LAYOUT, 8, TierConfig(**config), ssd_config=ssd_config, device="shm",
                              root=NAMESPACE.root, remote_store=store)
        self._close.callback(manager.close)  # before its store
        return manager

    def close(self) -> None:
        self._close.close()


@pytest.fixture
def nodes(redis_single):
    nodes = Nodes(((redis_single.host, redis_single.ports[0]),))
    yield nodes
    nodes.close()


@pytest.fixture
def store_client(redis_single):
    with contextlib.closing(redis_single.node_client(redis_single.ports[0])) as client:
        yield client


def stored_keys(manager: TierManager, chain=CHAIN) -> list[bytes]:
    return [manager.tiers.remote.key(h) for h in chain]


def computed(manager: TierManager, prompt=PROMPT, request_id="a") -> None:
    """The manager computes and commits `prompt`, releases it, and finishes every move and T3 write."""
    prefill(manager, request_id, prompt)
    manager.release(request_id)
    manager.drain()


def test_a_write_through_chain_is_acquired_by_another_node_with_its_exact_bytes(nodes, store_client):
    """Node A computes the prompt (T0 → T1 → T3 write-through); node B, with nothing local, acquires it:
    4 blocks from T3, the ticket resolves to 4, B's pool holds A's bytes, B's T1 holds them too, and
    B's stats count 4 T3 hits."""
    a = nodes.manager(t0_to_t1=EdgePolicy.WRITE_THROUGH)
    computed(a)
    assert store_client.exists(*stored_keys(a)) == 4
    assert a.stats().num_offloaded_blocks["t1_t3"] == 4 and a.stats().t3.num_written_blocks == 4
    b = nodes.manager()
    assert b.lookup(CHAIN, PROMPT).t3 == 4
    acquisition = b.acquire("b", CHAIN, 0, PROMPT)
    assert (acquisition.num_t0_hit_blocks, acquisition.num_t1_blocks, acquisition.num_t3_blocks) == (0, 0, 4)
    assert acquisition.ticket.wait(10) == 4
    assert_holds(b, acquisition.block_ids, CHAIN)
    assert b.index.lookup(CHAIN, PROMPT) == 4  # committed in T0
    assert b.tiers.host.index.lookup(CHAIN) == 4  # and in T1 (inclusive)
    stats = b.stats()
    assert stats.t3.num_hit_blocks == 4 and stats.t3.num_corrupt_blocks == 0
    assert b.tiers.counters.num_hit_blocks["t3"] == 4
    b.release("b")


def test_a_t3_hit_without_token_ids_takes_them_from_the_frames(nodes):
    """B acquires by hashes only: the blocks come with A's token ids, so a later lookup with tokens hits."""
    computed(nodes.manager(t0_to_t1=EdgePolicy.WRITE_THROUGH))
    b = nodes.manager()
    acquisition = b.acquire("b", CHAIN, 0)
    assert acquisition.num_t3_blocks == 4 and acquisition.ticket.wait(10) == 4
    assert_holds(b, acquisition.block_ids, CHAIN)
    assert b.index.lookup(CHAIN, PROMPT) == 4  # committed with the frames' token ids
    assert b.index.lookup(CHAIN, tokens(101, 4 * BLOCK_SIZE)) == 0
    b.release("b")


def test_local_hits_continue_in_t3(nodes):
    """B holds the prompt's first 2 blocks itself; acquiring all 4 takes 2 from T0 and the rest from T3."""
    b = nodes.manager(t1_to_t3=EdgePolicy.OFF)
    computed(b, PROMPT[:2 * BLOCK_SIZE], "first-half")  # before A: B computes them itself
    assert b.stats().t3.num_hit_blocks == 0
    computed(nodes.manager(t0_to_t1=EdgePolicy.WRITE_THROUGH))
    acquisition = b.acquire("b", CHAIN, 0, PROMPT)
    assert (acquisition.num_t0_hit_blocks, acquisition.num_t3_blocks) == (2, 2)
    assert acquisition.ticket.wait(10) == 4
    assert_holds(b, acquisition.block_ids, CHAIN)
    assert b.stats().t3.num_hit_blocks == 2
    b.release("b")


def test_t1_to_t3_off_writes_nothing(nodes, store_client):
    """Write-through into T1 with t1_to_t3 off: T1 holds the blocks, the store holds nothing."""
    a = nodes.manager(t0_to_t1=EdgePolicy.WRITE_THROUGH, t1_to_t3=EdgePolicy.OFF)
    computed(a)
    assert a.tiers.host.index.lookup(CHAIN) == 4
    assert store_client.dbsize() == 0
    assert a.stats().t3.num_written_blocks == 0 and a.stats().num_offloaded_blocks["t1_t3"] == 0
    assert nodes.manager().lookup(CHAIN, PROMPT).t3 == 0


def test_t1_to_t3_on_evict_writes_only_what_t1_evicts(nodes, store_client):
    """A T1 of 4 slots, t1_to_t3 on_evict: the prompt in T1 is not in the store; another prompt pushes it
    out of T1 and then (only then) it is in the store, and another node acquires it exactly."""
    a = nodes.manager(host_blocks=4, t0_to_t1=EdgePolicy.WRITE_THROUGH, t1_to_t3=EdgePolicy.ON_EVICT)
    computed(a)
    assert a.tiers.host.index.lookup(CHAIN) == 4 and store_client.dbsize() == 0
    other = tokens(5000, 4 * BLOCK_SIZE)
    computed(a, other, "other")
    assert a.tiers.host.index.lookup(CHAIN) == 0  # evicted from T1
    assert sorted(store_client.keys("*")) == sorted(stored_keys(a))  # exactly the victims, not `other`
    assert a.stats().num_offloaded_blocks["t1_t3"] == 4
    b = nodes.manager()
    acquisition = promote_exactly(b, "b", PROMPT)
    assert acquisition.num_t3_blocks == 4
    b.release("b")


def test_t2_to_t3_write_through_writes_what_t2_takes(nodes, store_client, tmp_path):
    """t1_to_t3 off, t2_to_t3 write_through: the blocks reach the store from T2 (counted on that edge)."""
    ssd = SsdTierConfig([str(tmp_path / "ssd")], capacity_bytes=64 * 4096)
    a = nodes.manager(ssd_config=ssd, t0_to_t1=EdgePolicy.WRITE_THROUGH, t1_to_t3=EdgePolicy.OFF,
                      t2_to_t3=EdgePolicy.WRITE_THROUGH)
    computed(a)
    assert a.tiers.ssd.lookup(CHAIN, NAMESPACE.root, None, BLOCK_SIZE) == 4
    assert store_client.exists(*stored_keys(a)) == 4
    offloaded = a.stats().num_offloaded_blocks
    assert (offloaded["t1_t2"], offloaded["t2_t3"], offloaded["t1_t3"]) == (4, 4, 0)
    b = nodes.manager()
    assert promote_exactly(b, "b", PROMPT).num_t3_blocks == 4
    b.release("b")


def test_a_store_that_is_down_costs_a_fast_miss_and_nothing_local(tmp_path):
    """Nothing at the store's address: acquiring a chain no tier holds returns at once with no T3 blocks;
    the node's own T0 and T1 hits work as without T3; writes are counted as failed."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        dead = (("127.0.0.1", probe.getsockname()[1]),)
    nodes = Nodes(dead)
    try:
        manager = nodes.manager(t0_to_t1=EdgePolicy.WRITE_THROUGH)
        unknown = tokens(777, 4 * BLOCK_SIZE)
        done = []

        def acquire() -> None:
            acquisition = manager.acquire("x", NAMESPACE.hash_blocks(unknown), 0, unknown)
            done.append((acquisition.num_t3_blocks, acquisition.ticket.wait(10)))

        thread = threading.Thread(target=acquire, daemon=True)
        thread.start()
        thread.join(10 * TIMEOUT_S)
        assert not thread.is_alive(), "acquire waited on a dead store"
        assert done == [(0, 0)]
        manager.release("x")
        computed(manager)
        assert manager.stats().t3.num_failed_writes == 4 and manager.stats().t3.num_written_blocks == 0
        manager.index.evict(CHAIN)
        manager.drain()
        acquisition = promote_exactly(manager, "b", PROMPT)
        assert (acquisition.num_t1_blocks, acquisition.num_t3_blocks) == (4, 0)
        manager.release("b")
    finally:
        nodes.close()
