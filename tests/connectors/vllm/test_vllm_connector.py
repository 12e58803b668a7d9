"""The vLLM connector against a real `kvtierd serve`, driven in the call order of vLLM engine steps."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch

from kvtierd.client import KvtierClient
from kvtierd.connectors.vllm.connector import KvtierdConnector, configure_logging
from kvtierd.connectors.vllm.group_hits import RequestHit
from kvtierd.connectors.vllm.kv_groups import engine_groups
from kvtierd.connectors.vllm.scheduler import SchedulerSide
from kvtierd.errors import ResourceExhausted
from kvtierd.launch.daemon_process import DaemonProcess, small_daemon_args, wait_until
from kvtierd.tier import TierCounts
from tests.connectors.vllm.vllm_fakes import (
    BLOCK_SIZE,
    KV_LAYOUTS,
    CachedRequestData,
    Engine,
    KVCacheBlocks,
    KVCacheConfig,
    NewRequestData,
    Request,
    SchedulerOutput,
    block_value,
    prompt,
    vllm_config,
)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    with DaemonProcess(small_daemon_args(str(tmp_path_factory.mktemp("kvtierd")))) as process:
        yield process


@pytest.fixture
def engines():
    made: list[Engine] = []
    yield made
    for engine in made:
        engine.close()


def as_bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(torch.int16)


@pytest.mark.parametrize("kv_layout", KV_LAYOUTS)
def test_a_second_request_loads_the_first_requests_bytes_into_its_own_blocks(daemon, engines, kv_layout):
    """A misses, is computed and stored; B, sharing 4 full blocks, is matched exactly those and
    its load writes A's bytes, bit for bit, into B's different engine blocks."""
    engine = Engine(daemon.address, kv_layout)
    engines.append(engine)
    seed = 100 + KV_LAYOUTS.index(kv_layout)
    a = Request(f"a-{kv_layout}", prompt(seed, 22))  # 5 full blocks and 2 tokens
    step_a = engine.prefill(a)
    assert step_a.num_external_tokens == 0
    assert step_a.metadata.loads == [] and [s.groups[0].blocks.num_blocks for s in step_a.metadata.stores] == [5]
    assert engine.finish(a, step_a.engine_block_ids) is True  # its store may still run
    engine.drain()
    assert a.request_id in engine.finished_sending
    a_bytes = [engine.block(block_id) for block_id in step_a.engine_block_ids[:4]]
    assert torch.equal(as_bits(a_bytes[2]), as_bits(block_value(a.block_hashes[2])))
    engine.zero_all_blocks()  # A's blocks are free: the engine may have reused them

    b = Request(f"b-{kv_layout}", prompt(seed + 50, 26, shared=a.all_token_ids[:16]))
    assert b.block_hashes[:4] == a.block_hashes[:4] and b.block_hashes[4] != a.block_hashes[4]
    step_b = engine.prefill(b)
    assert step_b.num_external_tokens == 4 * BLOCK_SIZE
    assert step_b.load_error_block_ids == set()
    assert [s.engine_block_ids for s in step_b.metadata.loads] == [tuple(step_b.engine_block_ids[:4])]
    assert not set(step_b.engine_block_ids) & set(step_a.engine_block_ids)
    for a_block, b_block_id in zip(a_bytes, step_b.engine_block_ids[:4]):
        assert torch.equal(as_bits(engine.block(b_block_id)), as_bits(a_block))
    assert engine.worker.worker.loads.num_loaded_blocks == 4


def test_a_prompt_that_is_all_cached_still_leaves_its_last_token_to_compute(daemon, engines):
    """Hits are capped at the full blocks before the last prompt token: vLLM samples from it."""
    engine = Engine(daemon.address)
    engines.append(engine)
    a = Request("all-cached-a", prompt(7, 20))  # exactly 5 full blocks
    engine.finish(a, engine.prefill(a).engine_block_ids)
    engine.drain()
    again = Request("all-cached-b", list(a.all_token_ids))
    assert engine.matched_tokens(again) == 4 * BLOCK_SIZE
    assert engine.matched_tokens(again, num_local_computed_tokens=2 * BLOCK_SIZE) == 2 * BLOCK_SIZE


def gated_side(hit: RequestHit, **settings) -> tuple[SchedulerSide, threading.Event, list[int]]:
    """A SchedulerSide whose lookups wait for the returned gate, then answer `hit`; the list
    records each lookup's number of positions."""
    gate = threading.Event()
    calls: list[int] = []

    def gated_lookup(query):
        calls.append(query.num_positions)
        gate.wait(10)
        return hit

    side = SchedulerSide(gated_lookup, engine_groups(KVCacheConfig(), prefix_caching=False), lookup_wait_s=0.0,
                         **settings)
    return side, gate, calls


def test_get_num_new_matched_tokens_is_none_while_the_lookup_is_pending_and_sends_one_rpc():
    """None until the lookup answers; repeated calls send no new lookup; then the hit count."""
    side, gate, calls = gated_side(RequestHit(3, TierCounts(1, 0, 2, 0), all_in_t0=False), lookup_timeout_s=60.0)
    request = Request("pending", prompt(3, 30))  # 7 full blocks, 7 = (30 - 1) // 4 lookable
    assert side.get_num_new_matched_tokens(request, 0) == (None, False)
    assert side.get_num_new_matched_tokens(request, 0) == (None, False)
    gate.set()
    deadline = time.monotonic() + 10
    while (answer := side.get_num_new_matched_tokens(request, 0)) == (None, False):
        assert time.monotonic() < deadline
    assert answer == (3 * BLOCK_SIZE, True)  # blocks in T2: loaded in the background
    assert calls == [7] and side.num_lookups == 1
    assert side.get_num_new_matched_tokens(request, 0) == (3 * BLOCK_SIZE, True) and side.num_lookups == 1
    assert side.external_hit_blocks("pending", 3 * BLOCK_SIZE) == TierCounts(1, 0, 2, 0)
    assert side.external_hit_blocks("pending", 2 * BLOCK_SIZE) == TierCounts(1, 0, 1, 0)  # T0's come first
    side.shutdown()


def test_request_finished_delays_the_free_while_a_store_is_in_flight(daemon, engines):
    """request_finished returns True; get_finished withholds the request until its store has
    run, then returns it once; the stored blocks are then visible to a lookup."""
    engine = Engine(daemon.address)
    engines.append(engine)
    gate = threading.Event()
    engine.worker.worker._executor.submit(gate.wait, 10)  # the store thread is busy: the store queues
    a = Request("in-flight", prompt(11, 16))
    step = engine.prefill(a)
    assert engine.finish(a, step.engine_block_ids) is True
    engine.idle_step()
    engine.idle_step()
    assert "in-flight" in engine.finished_waiting and "in-flight" not in engine.finished_sending
    assert not set(step.engine_block_ids) & set(engine.free_block_ids)  # still held for the store
    gate.set()
    engine.drain()
    assert engine.finished_sending == {"in-flight"}
    assert set(step.engine_block_ids) <= set(engine.free_block_ids)
    probe = Request("in-flight-probe", list(a.all_token_ids) + [1, 2, 3, 4, 5])
    assert engine.matched_tokens(probe) == 4 * BLOCK_SIZE


def test_a_request_without_full_blocks_is_freed_at_once(daemon, engines):
    """No store issued (3 tokens, no full block): request_finished returns False."""
    engine = Engine(daemon.address)
    engines.append(engine)
    short = Request("short", prompt(12, 3))
    step = engine.prefill(short)
    assert step.metadata.stores == []
    assert engine.finish(short, step.engine_block_ids) is False


def test_a_daemon_that_is_down_gives_no_hits_no_stores_and_load_errors_without_raising(tmp_path, engines):
    """No socket: 0 matched tokens at once, the store is dropped (the request still completes),
    and a planned load reports its engine blocks as load errors; nothing raises."""
    address = f"unix://{tmp_path}/absent.sock"
    engine = Engine(address, retry_after_s=0.0)
    engines.append(engine)
    a = Request("down-a", prompt(13, 22))
    started = time.monotonic()
    step = engine.prefill(a)
    assert step.num_external_tokens == 0 and time.monotonic() - started < 5
    assert engine.finish(a, step.engine_block_ids) is True
    engine.drain()  # the dropped store still completes the request
    # A load the scheduler planned (as if a lookup had hit) fails whole: reported, not raised.
    b = Request("down-b", prompt(14, 22))
    engine.scheduler.update_state_after_alloc(b, KVCacheBlocks([40, 41, 42, 43, 44, 45]), 2 * BLOCK_SIZE)
    engine.worker.bind_connector_metadata(engine.scheduler.build_connector_meta(empty_output()))
    engine.worker.start_load_kv(None)
    assert engine.worker.get_block_ids_with_load_errors() == {40, 41}
    assert engine.worker.get_block_ids_with_load_errors() == set()  # drained by the report


def empty_output() -> SchedulerOutput:
    return SchedulerOutput([], CachedRequestData(), {}, set())


def a_stored_and_b_looked_up(address: str, engines, name: str) -> tuple[Engine, Request, Request]:
    """An engine that prefilled and stored A (22 tokens) and looked up B, which shares A's first 4
    blocks: the scheduler saw them as hits."""
    engine = Engine(address, lookup_ttl_s=600.0, wait_timeout_s=10.0)
    engines.append(engine)
    a = Request(f"{name}-a", prompt(21, 22))
    step_a = engine.prefill(a)
    engine.finish(a, step_a.engine_block_ids)
    engine.drain()
    b = Request(f"{name}-b", prompt(22, 26, shared=a.all_token_ids[:16]))
    assert engine.matched_tokens(b) == 4 * BLOCK_SIZE
    return engine, a, b


@pytest.mark.parametrize("policy", ["off", "on_evict"])
def test_blocks_evicted_after_the_lookup_are_load_errors_or_come_back_from_t1(tmp_path, engines, policy):
    """Between B's lookup and its load the lookup's hold lapses (5 s) and another client evicts every
    T0 block. With T0→T1 off, B's engine blocks are reported as load errors; with on_evict they are
    promoted from T1 (Acquire pending, Wait) and land bit exact."""
    args = small_daemon_args(str(tmp_path), t0_bytes="64KiB", extra=["--set", f"policy.t0_to_t1={policy}"])
    with DaemonProcess(args) as daemon:
        engine, a, b = a_stored_and_b_looked_up(daemon.address, engines, "evict")  # the scheduler saw the hits
        with KvtierClient(daemon.address) as client:
            session = client.attach(engine.worker.layout, map_pool=False, keepalive=False)
            assert wait_until(lambda: fill_t0(session), timeout_s=20)  # once the hold lapsed: evicts all of T0
            lookup = lambda: session.lookup(a.block_hashes[:4], token_ids=a.all_token_ids[:16])  # noqa: E731
            assert lookup().total.t0 == 0
            if policy == "on_evict":  # the copies down run in the background: wait until T1 has them
                assert wait_until(lambda: lookup().total.t1 == 4, timeout_s=30)
        step_b = engine.prefill(b)
        assert step_b.num_external_tokens == 4 * BLOCK_SIZE
        assert engine.num_async_loads == 0  # the lookup saw T0 hits: a synchronous load
        if policy == "off":  # which finds them gone
            assert step_b.load_error_block_ids == set(step_b.engine_block_ids[:4])
        else:  # which promotes them back from T1 (Acquire pending, Wait)
            assert step_b.load_error_block_ids == set()
            for i in range(4):
                assert torch.equal(as_bits(engine.block(step_b.engine_block_ids[i])),
                                   as_bits(block_value(a.block_hashes[i])))
        engine.close()
        engines.remove(engine)


def fill_t0(session, num_blocks: int | None = None) -> bool:
    """Acquire and release `num_blocks` fresh T0 blocks (None: all of T0), evicting what they need;
    False when the pool cannot give them (blocks held)."""
    try:
        session.acquire("filler", [], num_extra_blocks=session.handle.num_blocks if num_blocks is None else num_blocks)
    except ResourceExhausted:
        return False
    session.release("filler")
    return True


def test_the_lookups_promise_is_held_until_the_load_and_its_acquire_gives_it_back(tmp_path, engines):
    """B's lookup holds the 4 T0 blocks it promises: another client can take every other T0 block
    (evicting the rest) but not those; B's load finds them in T0 (no load error, bit exact), and its
    Acquire gave the hold back: the whole of T0 can be taken again at once, not after the hold's 5 s."""
    args = small_daemon_args(str(tmp_path), t0_bytes="64KiB", extra=["--set", "policy.t0_to_t1=off"])
    with DaemonProcess(args) as daemon:
        engine, a, b = a_stored_and_b_looked_up(daemon.address, engines, "held")  # B's hits held
        with KvtierClient(daemon.address) as client:
            session = client.attach(engine.worker.layout, map_pool=False, keepalive=False)
            assert not fill_t0(session)
            assert fill_t0(session, session.handle.num_blocks - 4)
            step_b = engine.prefill(b)
            assert step_b.num_external_tokens == 4 * BLOCK_SIZE and step_b.load_error_block_ids == set()
            for i in range(4):
                assert torch.equal(as_bits(engine.block(step_b.engine_block_ids[i])),
                                   as_bits(block_value(a.block_hashes[i])))
            assert wait_until(lambda: fill_t0(session), timeout_s=2)
        engine.close()
        engines.remove(engine)


def test_a_hit_in_t1_loads_in_the_background_and_is_reported_in_finished_recving(tmp_path, engines):
    """The lookup sees T1 blocks: load_async; vLLM parks the request, idle steps run, the worker
    reports it in finished_recving, and its engine blocks hold A's bytes; hit sources say host."""
    args = small_daemon_args(str(tmp_path), t0_bytes="64KiB", extra=["--set", "policy.t0_to_t1=write_through"])
    with DaemonProcess(args) as daemon:
        engine = Engine(daemon.address, wait_timeout_s=10.0)
        engines.append(engine)
        a = Request("async-a", prompt(41, 22))
        engine.finish(a, engine.prefill(a).engine_block_ids)
        engine.drain()
        with KvtierClient(daemon.address) as client:
            session = client.attach(engine.worker.layout, map_pool=False, keepalive=False)
            session.acquire("filler", [], num_extra_blocks=session.handle.num_blocks)  # A's blocks leave T0
            session.release("filler")
            lookup = lambda: session.lookup(a.block_hashes[:4], token_ids=a.all_token_ids[:16])  # noqa: E731
            assert wait_until(lambda: lookup().total.t1 == 4, timeout_s=30)
        b = Request("async-b", prompt(42, 26, shared=a.all_token_ids[:16]))
        step_b = engine.prefill(b)
        assert step_b.num_external_tokens == 4 * BLOCK_SIZE and engine.num_async_loads == 1
        assert [spec.is_async for spec in step_b.metadata.loads] == [True]
        assert "async-b" in engine.finished_recving and step_b.load_error_block_ids == set()
        for i in range(4):
            assert torch.equal(as_bits(engine.block(step_b.engine_block_ids[i])),
                               as_bits(block_value(a.block_hashes[i])))
        sources = engine.scheduler.get_external_cache_hit_sources(b, 4 * BLOCK_SIZE)
        assert {str(getattr(k, "value", k)): v for k, v in sources.items()} == {"host": 4 * BLOCK_SIZE}
        engine.close()
        engines.remove(engine)


def test_the_connector_is_a_best_effort_cache_and_waits_for_preempted_stores(daemon, engines):
    """requires_kv_delivery is False; handle_preemptions(metadata) returns only once the
    preempted request's queued store has read its blocks."""
    engine = Engine(daemon.address)
    engines.append(engine)
    assert engine.worker.requires_kv_delivery is False and engine.scheduler.requires_kv_delivery is False
    gate = threading.Event()
    engine.worker.worker._executor.submit(gate.wait, 10)  # the store thread is busy: the store queues
    a = Request("preempted", prompt(43, 16))
    engine.prefill(a)
    metadata = type(engine.scheduler.build_connector_meta(empty_output()))(preempted_req_ids=("preempted",))
    waiter = threading.Thread(target=engine.worker.handle_preemptions, args=(metadata,))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive()  # the store has not run
    gate.set()
    waiter.join(10)
    assert not waiter.is_alive()
    assert engine.worker.worker.stores.num_stored_blocks == 4


def test_a_scheduler_side_connector_refuses_worker_calls():
    config = vllm_config("unix:///nonexistent")
    connector = KvtierdConnector(config, "scheduler", KVCacheConfig())
    with pytest.raises(RuntimeError, match="worker-side method"):
        connector.start_load_kv(None)
    connector.shutdown()


@pytest.mark.gpu
def test_cuda_engine_caches_share_a_prefix_through_the_daemon(daemon, engines):
    """Engine caches on CUDA (the gather/scatter kernels, a side stream and events): B's load is A's bytes."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    for kv_layout in KV_LAYOUTS:
        engine = Engine(daemon.address, kv_layout, device="cuda")
        engines.append(engine)
        a = Request(f"cuda-a-{kv_layout}", prompt(31 + len(kv_layout), 22))
        step_a = engine.prefill(a)
        engine.finish(a, step_a.engine_block_ids)
        engine.drain()
        engine.zero_all_blocks()
        b = Request(f"cuda-b-{kv_layout}", prompt(61 + len(kv_layout), 26, shared=a.all_token_ids[:16]))
        step_b = engine.prefill(b)
        torch.cuda.synchronize()
        assert step_b.num_external_tokens == 16 and step_b.load_error_block_ids == set()
        for i in range(4):
            assert torch.equal(as_bits(engine.block(step_b.engine_block_ids[i])),
                               as_bits(block_value(a.block_hashes[i])))


def test_blocks_vllm_computes_again_after_a_failed_load_are_offered_again():
    """A planned load of 4 blocks fails on some rank and vLLM recomputes from block 0: the step that
    computes them offers all 5 full blocks (the ranks holding them answer hits), not just the fifth."""
    side = SchedulerSide(lambda query: RequestHit(4, TierCounts(4, 0, 0, 0), all_in_t0=True),
                         engine_groups(KVCacheConfig(), prefix_caching=False), lookup_wait_s=5.0,
                         lookup_timeout_s=30.0)
    request = Request("reloaded", prompt(9, 22))  # 5 full blocks and 2 tokens
    block_ids = list(range(10, 16))
    assert side.get_num_new_matched_tokens(request, 0) == (4 * BLOCK_SIZE, False)
    side.update_state_after_alloc(request, KVCacheBlocks(block_ids), 4 * BLOCK_SIZE)
    request.num_computed_tokens = 0  # vLLM's _update_requests_with_invalid_blocks: back to the first failed block
    output = SchedulerOutput([NewRequestData(request.request_id, request.prompt_token_ids, (block_ids,), 0)],
                             CachedRequestData(), {request.request_id: 22}, set())
    (store,) = side.build_connector_meta(output).stores
    (offer,) = store.groups
    assert (offer.blocks.num_blocks, offer.num_new_blocks) == (5, 5)
    side.shutdown()


def test_a_lookup_slower_than_lookup_timeout_s_counts_no_hit_and_the_request_goes_on():
    """A daemon that hangs (or an Attach that builds a pool on a loaded node): None while the lookup is
    young, then 0 tokens, not a request that waits for the cache."""
    side, gate, _ = gated_side(RequestHit(3, TierCounts(3, 0, 0, 0), all_in_t0=True), lookup_timeout_s=0.2)
    request = Request("hanging", prompt(4, 30))
    assert side.get_num_new_matched_tokens(request, 0) == (None, False)
    deadline = time.monotonic() + 10
    while (answer := side.get_num_new_matched_tokens(request, 0)) == (None, False):
        assert time.monotonic() < deadline
    assert answer == (0, False)
    gate.set()
    side.shutdown()


def test_a_lookup_slower_than_lookup_ttl_s_is_used_once_it_answers():
    """The answer's lifetime starts when it arrives: a lookup that took longer than lookup_ttl_s (an
    Attach on a loaded node before it) is the hit, not thrown away for a new lookup."""
    side, gate, calls = gated_side(RequestHit(2, TierCounts(2, 0, 0, 0), all_in_t0=True), lookup_ttl_s=0.05,
                                   lookup_timeout_s=60.0)
    request = Request("slow", prompt(5, 30))
    assert side.get_num_new_matched_tokens(request, 0) == (None, False)
    ttl_passed_at = time.monotonic() + 0.1
    while time.monotonic() < ttl_passed_at:  # the lookup is in flight for longer than lookup_ttl_s
        assert side.get_num_new_matched_tokens(request, 0) == (None, False)
    gate.set()
    deadline = time.monotonic() + 10
    while (answer := side.get_num_new_matched_tokens(request, 0)) == (None, False):
        assert time.monotonic() < deadline
    assert answer == (2 * BLOCK_SIZE, False) and calls == [7] and side.num_lookups == 1
    side.shutdown()


def test_kvtierd_log_level_gives_the_connector_its_own_handler_and_a_bad_one_is_refused(monkeypatch):
    """vLLM configures only its loggers; KVTIERD_LOG_LEVEL=INFO makes the connector's INFO lines
    visible; a level that is not one fails in one line and leaves the loggers as they were."""
    package_log = logging.getLogger("kvtierd")
    monkeypatch.setattr(package_log, "handlers", [])
    monkeypatch.setattr(package_log, "level", logging.NOTSET)
    monkeypatch.setattr(package_log, "propagate", True)
    with pytest.raises(ValueError, match="KVTIERD_LOG_LEVEL='LOUD' is not a logging level"):
        configure_logging({"KVTIERD_LOG_LEVEL": "LOUD"})
    assert package_log.handlers == [] and package_log.level == logging.NOTSET
    configure_logging({})
    assert package_log.handlers == []  # no vLLM handler here (vLLM is not imported) and no level
    configure_logging({"KVTIERD_LOG_LEVEL": "info"})
    assert len(package_log.handlers) == 1 and package_log.level == logging.INFO and not package_log.propagate
    assert logging.getLogger("kvtierd.connectors.vllm.worker").isEnabledFor(logging.INFO)
    configure_logging({"KVTIERD_LOG_LEVEL": "DEBUG"})  # a second connector in the process adds none
    assert len(package_log.handlers) == 1 and package_log.level == logging.INFO
    package_log.setLevel(logging.NOTSET)  # clears the loggers' cached levels too


def test_the_connector_logs_through_the_handlers_vllm_configured(monkeypatch):
    """Under `vllm serve` (vLLM's logging configured) the connector's INFO lines go to vLLM's own
    handler, in its stream and format, without KVTIERD_LOG_LEVEL; the variable still sets the level."""
    package_log = logging.getLogger("kvtierd")
    monkeypatch.setattr(package_log, "handlers", [])
    monkeypatch.setattr(package_log, "level", logging.NOTSET)
    monkeypatch.setattr(package_log, "propagate", True)
    vllm_log = logging.Logger("vllm")  # as vLLM's DEFAULT_LOGGING_CONFIG leaves it: one handler
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    vllm_log.addHandler(handler)
    try:
        configure_logging({}, vllm_logger=vllm_log)
        assert package_log.handlers == [handler] and package_log.level == logging.INFO and not package_log.propagate
        logging.getLogger("kvtierd.connectors.daemon_link").info("attached to kvtierd at %s", "unix:///x")
        logging.getLogger("kvtierd.connectors.vllm.worker").debug("not shown at INFO")
        assert [r.getMessage() for r in records] == ["attached to kvtierd at unix:///x"]
        monkeypatch.setattr(package_log, "handlers", [])
        configure_logging({"KVTIERD_LOG_LEVEL": "warning"}, vllm_logger=vllm_log)
        assert package_log.handlers == [handler] and package_log.level == logging.WARNING
    finally:
        package_log.setLevel(logging.NOTSET)


def test_both_sides_attach_before_the_engine_serves_and_a_down_daemon_only_delays_them(daemon, engines, tmp_path):
    """The scheduler attaches when vLLM builds it, the worker when vLLM registers its KV caches
    (before the first forward, which may hold the GIL for seconds); with no daemon, each start
    gives up after its one bounded try and serves without the cache."""
    engine = Engine(daemon.address)
    engines.append(engine)
    assert engine.scheduler._scheduler_links[0].session(attach=False) is not None
    assert engine.worker.worker.link.session(attach=False) is not None
    with KvtierClient(daemon.address) as client:
        assert client.stats().num_sessions >= 2  # the daemon is the module's: earlier engines' may linger

    warnings = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = warnings.append
    link_log = logging.getLogger("kvtierd.connectors.daemon_link")
    link_log.addHandler(handler)
    try:
        down = Engine(f"unix://{tmp_path}/absent.sock", start_attach_s=2.0)
    finally:
        link_log.removeHandler(handler)
    engines.append(down)
    for link in (down.scheduler._scheduler_links[0], down.worker.worker.link):
        assert link.session(attach=False) is None and link.num_attach_failures == 1
    for side in (down.scheduler, down.worker):  # vllm:kvtierd_attach_failures_total, once per failure
        assert side.get_kv_connector_stats().data["attach_failures"] == 1
        assert side.get_kv_connector_stats() is None
    # one warning per side at start, naming the address the engine was given
    assert [w.getMessage().split(" (")[0] for w in warnings] == \
        [f"kvtierd connector: cannot attach to kvtierd at unix://{tmp_path}/absent.sock"] * 2
    with pytest.raises(ValueError, match="start_attach_s must be > 0"):
        Engine(daemon.address, start_attach_s=0)
