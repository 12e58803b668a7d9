"""The scheduler side of the vLLM connector: what to look up, load and store, per request and KV cache group.

Call order within one vLLM scheduler step (vllm/v1/core/sched/scheduler.py, `schedule`; the
contract is in vllm/distributed/kv_transfer/kv_connector/v1/base.py):
1. for a waiting request: `get_num_new_matched_tokens(request, num_local_computed_tokens)`,
   possibly many times across steps (it must be side-effect free), then, once blocks are
   allocated, `update_state_after_alloc(request, blocks, num_external_tokens)` (called for
   every newly scheduled request, also with 0 external tokens);
2. `build_connector_meta(scheduler_output)` once, before the request counters advance;
3. after the step's output, `request_finished_all_groups(request, block_ids)` (or, without the
   hybrid allocator, `request_finished`) for finished requests.

Lookups are asynchronous. `get_num_new_matched_tokens` submits the daemon's Lookup to one
background thread and waits at most `lookup_wait_s` (default 5 ms: a local Lookup takes well
under a millisecond) for it; if the answer is not there yet it returns None, which tells vLLM
to skip the request this step and ask again (base.py: "If None, it means that the connector
needs more time"). The answer is kept per request for `lookup_ttl_s` from its arrival (a lookup
slower than that is still used once), so repeated calls cost a
dict lookup and send no RPC. A daemon that is down or refuses answers 0 hits (logged), and so
does one slower than `lookup_timeout_s` (default 1 s: a first Attach that builds a pool on a
loaded node, a daemon that hangs): the request goes on without the cache, never waits for it. One
Lookup RPC per TP rank asks for every group at once (LookupRequest.chain_lengths: a chain per
attention group, a chain of one per candidate Mamba state), and the hit is what every group can
serve on every rank (group_hits.py).

Hits are capped one token short of the prompt: vLLM must compute at least the last prompt
token to sample (as ExampleConnector does, vllm/.../v1/example_connector.py,
`align_to_block_size(len(prompt) - 1)`). A hit that is all in T0 is loaded synchronously
(`load_async=False`): the worker copies it in `start_load_kv`, before the forward, a memcpy. A
hit with blocks in T1 or T2 is loaded asynchronously (`load_async=True`, unless `async_loads`
is off): vLLM parks the request in WAITING_FOR_REMOTE_KVS, the worker promotes and copies in the
background while the engine runs its other requests, and reports the request in
`finished_recving`; a promotion from SSD never holds a decode step
(vllm/v1/core/sched/scheduler.py, `_update_waiting_for_remote_kv`). A model with a Mamba group
always loads asynchronously: vLLM copies a hit's state into the request's running block before
the forward's synchronous loads land (vllm/v1/worker/gpu_model_runner.py, preprocess_mamba runs
first), so a synchronous load would be silently ignored.

Stores: every step, each scheduled request gets a StoreSpec with one GroupStore per group whose
blocks this step completed (blocks vLLM computes again after a failed load are offered again),
each the new blocks after their parent (the block before them, which the daemon got before: the
worker's Acquire of it checks the chain reaches them), never the whole chain again. Full
attention offers the blocks completed since its last offer (vLLM keeps them until the request
finishes); blocks the request found in vLLM's own cache are taken as held (they were stored when
computed): a request vLLM serves from its cache sends no store at all, and its first store
carries the blocks before the parent (`earlier`) to store from position 0 should the daemon have
lost the parent. A sliding-window group offers this step's blocks (vLLM frees out-of-window
blocks next step: `volatile`); a Mamba group offers the state block when the step ends exactly
on a block boundary (vLLM's align mode keeps the state at position i in that block; the next
step moves the state on). A request's first lookup is its query in the daemon's hit rate
(`LookupQuery.count_query`): the daemon counts there the positions asked, the hit it promises and
what it declines; later asks (polls, a new range after vLLM's own hit changed, a resumed
preemption) and the loads count nothing, as vLLM's external_prefix_cache counters count a request
once and leave preempted ones out (vllm/v1/metrics/stats.py, PrefixCacheStats.record). The
daemon leaves out of a hit what is slower to load than to recompute (vLLM computes it).
`request_finished` returns True (vLLM keeps the blocks) when any store was ever issued for the
request; the worker reports it in `finished_sending` once its stores are done.
A request's retention hint (vLLM's kv_transfer_params) rides on its stores: retention_plan.py.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import time
from collections.abc import Sequence
from typing import Any

from kvtierd.connectors.vllm.connector_stats import StatsRecorder
from kvtierd.connectors.vllm.group_hits import NO_HIT, RequestHit, needed_positions
from kvtierd.connectors.vllm.kv_groups import NULL_BLOCK_ID, EngineGroups, GroupKind
from kvtierd.connectors.vllm.lookup_query import LookupFn, LookupQuery
from kvtierd.connectors.vllm.metadata import GroupBlocks, GroupStore, LoadSpec, RetainSpec, StepMetadata, StoreSpec
from kvtierd.connectors.vllm.request_keys import RequestKeys
from kvtierd.connectors.vllm.retention_hints import PromptRetention
from kvtierd.connectors.vllm.retention_plan import first_step_retain, request_retention
from kvtierd.connectors.vllm.scheduler_output import scheduled_requests
from kvtierd.tier import TierCounts

log = logging.getLogger(__name__)


@dataclasses.dataclass(slots=True)
class _Lookup:
    """One lookup of chain positions [first_position, end_position); `answered_at` is set (by the
    lookup thread) when its answer arrives, from when it is kept `lookup_ttl_s`."""

    first_position: int
    end_position: int
    future: concurrent.futures.Future
    started_at: float
    count_query: bool = False  # the request's first lookup: its declined hits are counted
    answered_at: float | None = None
    observed: bool = False  # its round trip (and, for a query, its declined hits) is in the stats

    def __post_init__(self) -> None:
        self.future.add_done_callback(self._answered)

    def _answered(self, _future: concurrent.futures.Future) -> None:
        self.answered_at = time.monotonic()

    def expired(self, now: float, ttl_s: float) -> bool:
        """An answer older than `ttl_s` (a lookup still in flight never expires: it times out)."""
        answered_at = self.answered_at
        return answered_at is not None and now - answered_at > ttl_s


@dataclasses.dataclass(slots=True)
class _Tracked:
    """What the scheduler side keeps for one live request (mutated by the scheduler thread only)."""

    request: Any  # vllm.v1.request.Request
    keys: RequestKeys
    engine_block_ids: list[list[int]]  # per served group, by chain position (vLLM's null block included)
    num_offered_blocks: list[int]  # per served group: leading positions stored, loaded, or offered
    lookup: _Lookup | None = None
    hit: RequestHit = NO_HIT  # of the last answered lookup, for get_external_cache_hit_sources
    load_async: bool = False  # the answer given for the planned load
    num_local_computed_tokens: int = 0  # from the last get_num_new_matched_tokens call
    has_stores: bool = False  # a StoreSpec was issued: request_finished delays the free
    query_counted: bool = False  # a lookup of the request went out as its query
    stores_begun: bool = False  # _store_spec has run for the request (its first step is behind)
    retention: PromptRetention | None = None  # its valid retention hint (retention_plan.py)


class SchedulerSide:
    """Per-request lookup results, the loads to issue, the stores to issue, and which finished
    requests hold their blocks until their stores finish. Single-threaded (vLLM's scheduler);
    only lookups run on `executor`."""

    def __init__(self, lookup_fn: LookupFn, engine: EngineGroups, *, loads: bool = True, stores: bool = True,
                 lookup_wait_s: float = 0.005, lookup_ttl_s: float = 2.0, lookup_timeout_s: float = 1.0,
                 async_loads: bool = True, executor: concurrent.futures.Executor | None = None) -> None:
        if lookup_wait_s < 0 or lookup_ttl_s <= 0 or lookup_timeout_s < lookup_wait_s:
            raise ValueError(f"bad scheduler settings: lookup_wait_s={lookup_wait_s}, lookup_ttl_s={lookup_ttl_s}, "
                             f"lookup_timeout_s={lookup_timeout_s}")
        self.lookup_timeout_s = lookup_timeout_s
        self.lookup_fn = lookup_fn
        self.engine = engine
        self.block_size = engine.block_size
        self.loads_enabled = loads
        self.stores_enabled = stores
        self.lookup_wait_s = lookup_wait_s
        self.lookup_ttl_s = lookup_ttl_s
        self.async_loads = async_loads
        self._executor = executor or concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvtierd-lookup")
        self._tracked: dict[str, _Tracked] = {}
        self._loads_to_issue: dict[str, LoadSpec] = {}
        self.num_lookups = 0  # RPCs submitted, for tests and logs
        self.stats = StatsRecorder()  # the lookups' round trips, for vLLM's connector metrics

    def _track(self, request: Any) -> _Tracked:
        tracked = self._tracked.get(request.request_id)
        if tracked is None:
            num_groups = len(self.engine.groups)
            tracked = self._tracked[request.request_id] = _Tracked(
                request, RequestKeys(self.engine), [[] for _ in range(num_groups)], [0] * num_groups,
                retention=request_retention(request, self.stats) if self.stores_enabled else None)
        tracked.request = request
        return tracked

    # ------------------------------------------------------------------ lookups

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """(tokens the daemon can add beyond `num_computed_tokens`, load asynchronously), or
        (None, False) while the lookup is in flight."""
        if not self.loads_enabled:
            return 0, False
        block_size = self.block_size
        tracked = self._track(request)
        first = num_computed_tokens // block_size
        end = min(tracked.keys.update(request), (request.num_tokens - 1) // block_size)
        if num_computed_tokens % block_size or end <= first:
            return 0, False
        tracked.num_local_computed_tokens = num_computed_tokens
        lookup = tracked.lookup
        now = time.monotonic()
        if lookup is None or (lookup.first_position, lookup.end_position) != (first, end) or \
                lookup.expired(now, self.lookup_ttl_s):
            count_query, tracked.query_counted = not tracked.query_counted, True
            query = LookupQuery(first, tuple(tuple(keys[first:end]) for keys in tracked.keys.keys),
                                tuple(request.all_token_ids[first * block_size:end * block_size]), count_query,
                                hold_id=request.request_id if self.loads_enabled else "")
            lookup = tracked.lookup = _Lookup(first, end, self._executor.submit(self.lookup_fn, query), now,
                                              count_query)
            self.num_lookups += 1
        try:
            hit = lookup.future.result(timeout=self.lookup_wait_s)
            if not lookup.observed:
                lookup.observed = True
                answered_at = lookup.answered_at or time.monotonic()  # its callback may not have run yet
                self.stats.observe_lookup(answered_at - lookup.started_at)
                if lookup.count_query:
                    self.stats.add_declined_tokens(hit.declined, block_size)
        except concurrent.futures.TimeoutError:
            if time.monotonic() - lookup.started_at < self.lookup_timeout_s:
                return None, False
            log.warning("kvtierd connector: the lookup of %s took over %.1f s; counting no hit",
                        request.request_id, self.lookup_timeout_s)
            hit = NO_HIT
        except Exception as error:  # a bug in a lookup must not stop the engine
            log.warning("kvtierd connector: lookup of %s raised %r; counting no hit", request.request_id, error)
            hit = NO_HIT
        assert 0 <= hit.num_blocks <= end - first, (hit, first, end)
        tracked.hit = hit
        tracked.load_async = hit.num_blocks > 0 and (self.engine.has_mamba or (self.async_loads and not hit.all_in_t0))
        return hit.num_blocks * block_size, tracked.load_async

    def external_hit_blocks(self, request_id: str, num_external_tokens: int) -> TierCounts:
        """The leading `num_external_tokens` of the request's last lookup (whole blocks: update_state_after_alloc
        checks) as blocks per tier; blocks it did not attribute (it never happens: they are its hits) count in T3."""
        tracked = self._tracked.get(request_id)
        tier_blocks = tracked.hit.tier_blocks if tracked is not None else NO_HIT.tier_blocks
        num_blocks = num_external_tokens // self.block_size
        hit = tier_blocks.first(num_blocks)
        return hit + TierCounts(t3=num_blocks - hit.num_blocks)

    # ------------------------------------------------------------------ allocation

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Track the request; with external tokens, plan the load into its allocated blocks."""
        tracked = self._track(request)
        tracked.lookup = None  # consumed: a preempted and resumed request looks up afresh
        if num_external_tokens == 0:
            return
        block_size = self.block_size
        if num_external_tokens % block_size:
            raise ValueError(f"external tokens {num_external_tokens} are not whole blocks of {block_size}")
        first = tracked.num_local_computed_tokens // block_size
        end = first + num_external_tokens // block_size
        block_ids = blocks.get_block_ids()
        num_keyed = tracked.keys.update(request)
        groups = []
        for index, group in enumerate(self.engine.groups):
            ids = list(block_ids[group.group_id])
            assert end <= len(ids) and end <= num_keyed, (first, end, len(ids), num_keyed)
            positions = [first + p for p in needed_positions(group, end - first)]
            while positions and ids[positions[0]] == NULL_BLOCK_ID:  # vLLM needs no page there
                positions.pop(0)
            if positions:
                start = positions[0]
                groups.append(GroupBlocks(group.group_id, start, tuple(tracked.keys.keys[index][start:end]),
                                          tuple(request.all_token_ids[start * block_size:end * block_size]),
                                          tuple(ids[start:end])))
            tracked.num_offered_blocks[index] = max(tracked.num_offered_blocks[index], end)  # the daemon holds them
        if groups:
            self._loads_to_issue[request.request_id] = LoadSpec(request.request_id, tuple(groups), tracked.load_async)

    # ------------------------------------------------------------------ per step

    def build_connector_meta(self, scheduler_output: Any) -> StepMetadata:
        """This step's loads (planned since the last call) and stores; resets the loads."""
        loads = list(self._loads_to_issue.values())
        self._loads_to_issue = {}
        preempted = tuple(sorted(getattr(scheduler_output, "preempted_req_ids", None) or ()))
        for request_id in preempted:
            if request_id in self._tracked:
                self._reset_block_ids(self._tracked[request_id])  # resumed requests get a full list
        stores, retains = [], []
        for request_id, new_block_ids, resumed in scheduled_requests(scheduler_output):
            tracked = self._tracked.get(request_id)
            if tracked is None:
                continue
            if resumed:
                self._reset_block_ids(tracked)
            if new_block_ids:
                for ids, group in zip(tracked.engine_block_ids, self.engine.groups):
                    ids.extend(new_block_ids[group.group_id])
            if self.stores_enabled:
                retain = self._first_step_retain(tracked) if not tracked.stores_begun else None
                spec = self._store_spec(tracked, scheduler_output.num_scheduled_tokens.get(request_id, 0))
                stores += [spec] if spec is not None else []
                retains += [retain] if retain is not None else []
        return StepMetadata(loads=loads, stores=stores, preempted_req_ids=preempted, retains=retains,
                            num_scheduled_tokens=sum(scheduler_output.num_scheduled_tokens.values()),
                            num_prefill_tokens=self._num_prefill_tokens(scheduler_output.num_scheduled_tokens))

    def _num_prefill_tokens(self, num_scheduled_tokens: dict[str, int]) -> int:
        """Of the step's scheduled tokens, those of requests still in their prompt (before the
        counters advance: vLLM builds the metadata first)."""
        num_tokens = 0
        for request_id, num_scheduled in num_scheduled_tokens.items():
            tracked = self._tracked.get(request_id)
            if tracked is not None:
                request = tracked.request
                num_tokens += min(num_scheduled, max(0, request.num_prompt_tokens - request.num_computed_tokens))
        return num_tokens

    @staticmethod
    def _reset_block_ids(tracked: _Tracked) -> None:
        for ids in tracked.engine_block_ids:
            ids.clear()

    def _store_spec(self, tracked: _Tracked, num_scheduled_tokens: int) -> StoreSpec | None:
        """The GroupStores of the blocks this step completes (see the module docstring)."""
        request = tracked.request
        block_size = self.block_size
        computed_before = request.num_computed_tokens
        num_computed_blocks = computed_before // block_size
        computed_after = min(computed_before + num_scheduled_tokens, request.num_tokens)
        num_complete = min(computed_after // block_size, tracked.keys.update(request))
        first_step, tracked.stores_begun = not tracked.stores_begun, True
        offers = []
        for index, group in enumerate(self.engine.groups):
            num_blocks = min(num_complete, len(tracked.engine_block_ids[index]))
            # Blocks past what vLLM counts as computed are being computed again (a load that failed on
            # some rank, a resumed preemption): offer them again; the ranks that hold them answer hits.
            offered = min(tracked.num_offered_blocks[index], num_computed_blocks)
            from_own_cache = first_step and group.kind is GroupKind.FULL and offered < num_computed_blocks
            if from_own_cache:  # vLLM's own hits were stored when computed: taken as held, the parent checks it
                offered = num_computed_blocks
            tracked.num_offered_blocks[index] = offered
            if num_blocks <= offered:
                continue
            tracked.num_offered_blocks[index] = num_blocks
            if group.kind is GroupKind.MAMBA:
                if computed_after != num_blocks * block_size:
                    continue  # the state in the running block is past the boundary
                start = new_start = num_blocks - 1
            else:
                new_start = offered if group.kind is GroupKind.FULL else max(offered, num_computed_blocks)
                if new_start >= num_blocks:
                    continue
                start = max(new_start - 1, 0)  # the parent, stored or loaded before, then the new blocks
            offers.append(GroupStore(self._group_blocks(tracked, index, start, num_blocks), num_blocks - new_start,
                                     volatile=group.kind is not GroupKind.FULL,
                                     earlier=self._group_blocks(tracked, index, 0, start) if from_own_cache and start
                                     else None))
        if not offers:
            return None
        tracked.has_stores = True
        return StoreSpec(request.request_id, tuple(offers), tracked.retention)

    def _first_step_retain(self, tracked: _Tracked) -> RetainSpec | None:
        """The Retain renewing a hinted request's blocks the daemon held before its first step."""
        if tracked.retention is None:
            return None
        tracked.keys.update(tracked.request)
        full_keys = [keys for keys, group in zip(tracked.keys.keys, self.engine.groups) if group.kind is GroupKind.FULL]
        return first_step_retain(tracked.request.request_id, tracked.retention, full_keys,
                                 tracked.request.num_computed_tokens, tracked.hit.declined.num_blocks > 0,
                                 self.block_size)

    def _group_blocks(self, tracked: _Tracked, index: int, start: int, end: int) -> GroupBlocks:
        """Chain positions [start, end) of the request's `index`th served group."""
        block_size = self.block_size
        return GroupBlocks(self.engine.groups[index].group_id, start, tuple(tracked.keys.keys[index][start:end]),
                           tuple(tracked.request.all_token_ids[start * block_size:end * block_size]),
                           tuple(tracked.engine_block_ids[index][start:end]))

    def request_finished(self, request: Any, block_ids: Sequence[Any]) -> tuple[bool, dict | None]:
        """(True: keep the blocks until the worker reports the stores done, None)."""
        tracked = self._tracked.pop(request.request_id, None)
        self._loads_to_issue.pop(request.request_id, None)
        return (tracked is not None and tracked.has_stores), None

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
