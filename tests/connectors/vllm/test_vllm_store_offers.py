"""The connector's incremental store path: each step offers its new blocks after their parent,
never the whole chain again; requests served from vLLM's own cache send no store; the daemon's
query count takes each request's first ask once."""

from __future__ import annotations

import pytest

from kvtierd.client import KvtierClient
from kvtierd.connectors.vllm.group_hits import NO_HIT, RequestHit
from kvtierd.connectors.vllm.kv_groups import engine_groups
from kvtierd.connectors.vllm.lookup_query import LookupQuery
from kvtierd.connectors.vllm.scheduler import SchedulerSide
from kvtierd.launch.daemon_process import wait_until
from tests.connectors.vllm.vllm_fakes import (
    BLOCK_SIZE,
    CachedRequestData,
    Engine,
    KVCacheBlocks,
    KVCacheConfig,
    Request,
    SchedulerOutput,
    new_request_data,
    prompt,
    running_request_data,
)


def scheduler(lookup=lambda query: NO_HIT) -> SchedulerSide:
    return SchedulerSide(lookup, engine_groups(KVCacheConfig(), prefix_caching=True), lookup_wait_s=5.0,
                         lookup_timeout_s=30.0)


def first_step(request: Request, block_ids: list[int], num_computed: int, num_scheduled: int) -> SchedulerOutput:
    """The step that schedules `request` new, with `num_computed` tokens already there."""
    return SchedulerOutput([new_request_data(request, block_ids, num_computed)], CachedRequestData(),
                           {request.request_id: num_scheduled}, set())


def next_step(request: Request, num_scheduled: int) -> SchedulerOutput:
    return SchedulerOutput([], running_request_data([request]), {request.request_id: num_scheduled}, set())


def test_a_chunked_prefill_offers_each_chunks_blocks_after_one_parent():
    side = scheduler()
    request = Request("chunked", prompt(1, 6 * BLOCK_SIZE + 1))
    block_ids = list(range(20, 27))
    side.update_state_after_alloc(request, KVCacheBlocks(block_ids), 0)
    (store,) = side.build_connector_meta(first_step(request, block_ids, 0, 3 * BLOCK_SIZE)).stores
    (offer,) = store.groups
    assert (offer.blocks.first_position, offer.blocks.num_blocks, offer.num_new_blocks, offer.earlier) == (0, 3, 3,
                                                                                                          None)
    request.num_computed_tokens = 3 * BLOCK_SIZE
    (store,) = side.build_connector_meta(next_step(request, 3 * BLOCK_SIZE + 1)).stores
    (offer,) = store.groups
    assert (offer.blocks.first_position, offer.blocks.num_blocks, offer.num_new_blocks) == (2, 4, 3)
    assert offer.blocks.block_hashes[0] == side._tracked["chunked"].keys.keys[0][2]  # the parent
    assert offer.blocks.engine_block_ids == tuple(block_ids[2:6])
    assert offer.blocks.token_ids == tuple(request.all_token_ids[2 * BLOCK_SIZE:6 * BLOCK_SIZE])
    side.shutdown()


def test_blocks_from_vllms_own_cache_are_not_offered_again_and_a_request_all_cached_sends_no_store():
    side = scheduler()
    partly = Request("partly", prompt(2, 5 * BLOCK_SIZE + 2))  # 3 blocks in vLLM's cache, 2 to compute
    ids = list(range(30, 36))
    side.update_state_after_alloc(partly, KVCacheBlocks(ids), 0)
    (store,) = side.build_connector_meta(first_step(partly, ids, 3 * BLOCK_SIZE, 2 * BLOCK_SIZE + 2)).stores
    (offer,) = store.groups
    assert (offer.blocks.first_position, offer.blocks.num_blocks, offer.num_new_blocks) == (2, 3, 2)
    assert offer.earlier is not None and (offer.earlier.first_position, offer.earlier.num_blocks) == (0, 2)
    assert offer.earlier.then(offer.blocks).engine_block_ids == tuple(ids[:5])

    cached = Request("cached", prompt(3, 3 * BLOCK_SIZE + 2))  # every full block in vLLM's cache
    ids = list(range(40, 44))
    side.update_state_after_alloc(cached, KVCacheBlocks(ids), 0)
    assert side.build_connector_meta(first_step(cached, ids, 3 * BLOCK_SIZE, 2)).stores == []
    assert side.request_finished(cached, ids) == (False, None)  # nothing to wait for: freed at once
    side.shutdown()


def test_a_request_counts_as_a_query_once_whatever_it_asks_later():
    """As vLLM counts a request's external query once (at admission; a resumed preemption not again):
    its first lookup is the query, a poll after the answer expired and a new range are not."""
    queries: list[LookupQuery] = []

    def lookup(query: LookupQuery) -> RequestHit:
        queries.append(query)
        return NO_HIT

    side = SchedulerSide(lookup, engine_groups(KVCacheConfig(), prefix_caching=True), lookup_wait_s=5.0,
                         lookup_timeout_s=30.0, lookup_ttl_s=1e-6)
    request = Request("asks", prompt(4, 4 * BLOCK_SIZE + 3))
    for _ in range(2):  # the second ask comes after the answer expired: a new RPC, not a new query
        assert wait_until(lambda: side._tracked.get("asks") is None or side._tracked["asks"].lookup is None
                          or side._tracked["asks"].lookup.future.done())
        assert side.get_num_new_matched_tokens(request, 0) == (0, False)
    assert side.get_num_new_matched_tokens(request, BLOCK_SIZE) == (0, False)  # vLLM's own hit grew
    assert [(q.first_position, q.count_query) for q in queries] == [(0, True), (0, False), (1, False)]
    side.shutdown()


def num_blocks_anywhere(client: KvtierClient) -> int:
    """Blocks the daemon holds in any tier of any pool."""
    return sum(tier.num_cached_blocks for pool in client.stats().pools for tier in pool.tiers)


@pytest.fixture
def attached(daemon):
    """(a fake engine with the connector on `daemon`, its worker side, a session of the engine's layout)."""
    engine = Engine(daemon.address)
    worker = engine.worker._worker()
    try:
        with KvtierClient(daemon.address) as client:
            yield engine, worker, client, client.attach(worker.link.layout, map_pool=False)
    finally:
        engine.close()


def test_stores_send_only_new_blocks_and_a_lost_parent_is_stored_again_from_vllms_own_cache(attached):
    engine, worker, client, session = attached
    def held(request: Request) -> int:
        return session.lookup(request.block_hashes, token_ids=request.all_token_ids).total.num_blocks

    request = Request("chunks", prompt(5, 6 * BLOCK_SIZE + 1))
    ids = engine.free_block_ids[:7]
    engine.scheduler.update_state_after_alloc(request, KVCacheBlocks(ids), 0)
    engine.compute_step(first_step(request, ids, 0, 3 * BLOCK_SIZE), [(request, ids, range(3))])
    # the worker counts a store once its Commit returned, after the daemon shows the blocks
    assert wait_until(lambda: held(request) == 3 and worker.stores.num_stored_blocks == 3)
    worker.stats.take()
    engine.compute_step(next_step(request, 3 * BLOCK_SIZE + 1), [(request, ids, range(3, 6))])
    assert wait_until(lambda: held(request) == 6 and worker.stores.num_stored_blocks == 6)
    sent = worker.stats.take().data
    assert sent["store_request_bytes"] == (32 + 4 * BLOCK_SIZE) * (4 + 3)  # Acquire 4 blocks, Commit 3
    assert (sent["store_rpcs"], sent["stored_blocks"]) == (2, 3)  # Acquire, Commit that releases

    # The daemon loses every block, in every tier: an eviction from T0 copies blocks down to T1, and
    # one that lands after the evict is evicted by the next (a chain missing only its first block
    # would still give the next store its parent).
    assert wait_until(lambda: client.evict(all_tenants=True) is not None and num_blocks_anywhere(client) == 0)
    again = Request("again", request.prompt_token_ids)
    ids = engine.free_block_ids[7:14]
    engine.scheduler.update_state_after_alloc(again, KVCacheBlocks(ids), 0)
    engine.compute_step(first_step(again, ids, 5 * BLOCK_SIZE, BLOCK_SIZE + 1), [(again, ids, range(6))])
    assert wait_until(lambda: held(again) == 6)  # the parent was gone: stored from position 0
    assert worker.stores.num_dropped_stores == 0


def test_a_step_whose_parent_the_daemon_lost_mid_request_is_dropped_and_counted(attached):
    engine, worker, client, session = attached
    request = Request("lost", prompt(6, 4 * BLOCK_SIZE + 1))
    ids = engine.free_block_ids[:5]
    engine.scheduler.update_state_after_alloc(request, KVCacheBlocks(ids), 0)
    engine.compute_step(first_step(request, ids, 0, 2 * BLOCK_SIZE), [(request, ids, range(2))])

    def held() -> int:
        return session.lookup(request.block_hashes, token_ids=request.all_token_ids).total.num_blocks

    assert wait_until(lambda: held() == 2)
    assert wait_until(lambda: client.evict(all_tenants=True) is not None and num_blocks_anywhere(client) == 0)
    engine.compute_step(next_step(request, 2 * BLOCK_SIZE + 1), [(request, ids, range(2, 4))])
    assert wait_until(lambda: worker.stores.num_dropped_stores == 1)
    engine.finish(request, ids)
    engine.drain()
    hashes = request.block_hashes
    assert session.lookup(hashes[2:], token_ids=request.all_token_ids[2 * BLOCK_SIZE:]).total.num_blocks == 0
