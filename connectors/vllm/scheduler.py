"""The scheduler side of the vLLM connector: what to look up, load and store, per request.

Call order within one vLLM scheduler step (vllm/v1/core/sched/scheduler.py, `schedule`; the
contract is in vllm/distributed/kv_transfer/kv_connector/v1/base.py):
1. for a waiting request: `get_num_new_matched_tokens(request, num_local_computed_tokens)`,
   possibly many times across steps (it must be side-effect free), then, once blocks are
   allocated, `update_state_after_alloc(request, blocks, num_external_tokens)` (called for
   every newly scheduled request, also with 0 external tokens);
2. `build_connector_meta(scheduler_output)` once, before the request counters advance;
3. after the step's output, `request_finished(request, block_ids)` for finished requests.

Lookups are asynchronous. `get_num_new_matched_tokens` submits the daemon's Lookup to one
background thread and waits at most `lookup_wait_s` (default 5 ms: a local Lookup takes well
under a millisecond) for it; if the answer is not there yet it returns None, which tells vLLM
to skip the request this step and ask again (base.py: "If None, it means that the connector
needs more time"). The answer is kept per request for `lookup_ttl_s`, so repeated calls cost a
dict lookup and send no RPC. A daemon that is down or refuses answers 0 hits (logged).

Hits are capped one token short of the prompt: vLLM must compute at least the last prompt
token to sample (as ExampleConnector does, vllm/.../v1/example_connector.py,
`align_to_block_size(len(prompt) - 1)`). A hit that is all in T0 is loaded synchronously
(`load_async=False`): the worker copies it in `start_load_kv`, before the forward, a memcpy. A
hit with blocks in T1 or T2 is loaded asynchronously (`load_async=True`, unless
`async_loads` is off): vLLM parks the request in WAITING_FOR_REMOTE_KVS, the worker promotes
and copies in the background while the engine runs its other requests, and reports the
request in `finished_recving`; a promotion from SSD never holds a decode step
(vllm/v1/core/sched/scheduler.py, `_update_waiting_for_remote_kv`). vLLM then calls
`update_state_after_alloc` a second time, with 0 external tokens.

Stores: every step, each scheduled request whose computed tokens now fill more full blocks
than were offered gets a StoreSpec for its chain up to its last full block. `request_finished`
returns True (vLLM keeps the blocks) when any store was ever issued for the request; the worker
reports the request in `finished_sending` once its stores are done, and only then does vLLM
free the blocks. The worker applies the same rule, so the two sides agree without messages.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from kvtierd.connectors.vllm.daemon_link import DaemonLink
from kvtierd.connectors.vllm.metadata import LoadSpec, StepMetadata, StoreSpec
from kvtierd.errors import KvtierError

log = logging.getLogger(__name__)

@dataclasses.dataclass(frozen=True, slots=True)
class LookupHits:
    """Leading blocks the daemon holds, by tier: T0's come first in the chain, then T1's, T2's, T3's."""

    num_t0_blocks: int = 0
    num_t1_blocks: int = 0
    num_t2_blocks: int = 0
    num_t3_blocks: int = 0  # in the shared store: present when asked, verified when loaded

    @property
    def num_blocks(self) -> int:
        return self.num_t0_blocks + self.num_t1_blocks + self.num_t2_blocks + self.num_t3_blocks


NO_HITS = LookupHits()

# (block hashes, their token ids) -> the leading blocks the daemon holds
LookupFn = Callable[[Sequence[bytes], Sequence[int]], LookupHits]


def daemon_lookup(link: DaemonLink, *, prefetch: bool = True) -> LookupFn:
    """A LookupFn asking the daemon behind `link`; 0 hits when it cannot be asked."""
    def lookup(block_hashes: Sequence[bytes], token_ids: Sequence[int]) -> LookupHits:
        session = link.session()
        if session is None:
            return NO_HITS
        if any(len(block_hash) != session.hash_size for block_hash in block_hashes):
            log.warning("kvtierd connector: vLLM block hashes are not %d bytes (hash_algo %s); no lookup",
                        session.hash_size, link.hash_algo)
            return NO_HITS
        try:
            response = session.lookup(list(block_hashes), token_ids=list(token_ids), prefetch=prefetch)
        except KvtierError as error:
            link.failed(session, error)
            log.warning("kvtierd connector: lookup failed (%s: %s); counting no hit", type(error).__name__, error)
            return NO_HITS
        return LookupHits(response.num_t0_blocks, response.num_t1_blocks, response.num_t2_blocks,
                          response.num_t3_blocks)
    return lookup


@dataclasses.dataclass(slots=True)
class _Lookup:
    """One lookup of chain positions [first_block_index, end_block_index)."""

    first_block_index: int
    end_block_index: int
    future: concurrent.futures.Future
    started_at: float


@dataclasses.dataclass(slots=True)
class _Tracked:
    """What the scheduler side keeps for one live request (mutated by the scheduler thread only)."""

    request: Any  # vllm.v1.request.Request
    lookup: _Lookup | None = None
    hits: LookupHits = NO_HITS  # of the last answered lookup, for get_external_cache_hit_sources
    load_async: bool = False  # the answer given for the planned load
    num_local_computed_tokens: int = 0  # from the last get_num_new_matched_tokens call
    engine_block_ids: list[int] = dataclasses.field(default_factory=list)  # kv cache group 0
    num_offered_blocks: int = 0  # leading blocks already stored, loaded, or offered to the daemon
    has_stores: bool = False  # a StoreSpec was issued: request_finished delays the free


class SchedulerSide:
    """Per-request lookup results, the loads to issue, the stores to issue, and which finished
    requests hold their blocks until their stores finish. Single-threaded (vLLM's scheduler);
    only lookups run on `executor`."""

    def __init__(self, lookup_fn: LookupFn, block_size: int, *, loads: bool = True, stores: bool = True,
                 lookup_wait_s: float = 0.005, lookup_ttl_s: float = 2.0, async_loads: bool = True,
                 executor: concurrent.futures.Executor | None = None) -> None:
        if block_size <= 0 or lookup_wait_s < 0 or lookup_ttl_s <= 0:
            raise ValueError(f"bad scheduler settings: block_size={block_size}, lookup_wait_s={lookup_wait_s}, "
                             f"lookup_ttl_s={lookup_ttl_s}")
        self.lookup_fn = lookup_fn
        self.block_size = block_size
        self.loads_enabled = loads
        self.stores_enabled = stores
        self.lookup_wait_s = lookup_wait_s
        self.lookup_ttl_s = lookup_ttl_s
        self.async_loads = async_loads
        self._executor = executor or concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvtierd-lookup")
        self._tracked: dict[str, _Tracked] = {}
        self._loads_to_issue: dict[str, LoadSpec] = {}
        self.num_lookups = 0  # RPCs submitted, for tests and logs

    # ------------------------------------------------------------------ lookups

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """(tokens the daemon can add beyond `num_computed_tokens`, load asynchronously), or
        (None, False) while the lookup is in flight."""
        if not self.loads_enabled:
            return 0, False
        block_size = self.block_size
        first = num_computed_tokens // block_size
        end = min(len(request.block_hashes), (request.num_tokens - 1) // block_size)
        if num_computed_tokens % block_size or end <= first:
            return 0, False
        tracked = self._tracked.setdefault(request.request_id, _Tracked(request))
        tracked.request = request
        tracked.num_local_computed_tokens = num_computed_tokens
        lookup = tracked.lookup
        now = time.monotonic()
        if lookup is None or (lookup.first_block_index, lookup.end_block_index) != (first, end) or (
                lookup.future.done() and now - lookup.started_at > self.lookup_ttl_s):
            hashes = [bytes(h) for h in request.block_hashes[first:end]]
            tokens = list(request.all_token_ids[first * block_size:end * block_size])
            lookup = tracked.lookup = _Lookup(first, end, self._executor.submit(self.lookup_fn, hashes, tokens), now)
            self.num_lookups += 1
        try:
            hits = lookup.future.result(timeout=self.lookup_wait_s)
        except concurrent.futures.TimeoutError:
            return None, False
        except Exception as error:  # a bug in a lookup must not stop the engine
            log.warning("kvtierd connector: lookup of %s raised %r; counting no hit", request.request_id, error)
            hits = NO_HITS
        assert 0 <= hits.num_blocks <= end - first, (hits, first, end)
        tracked.hits = hits
        tracked.load_async = self.async_loads and hits.num_blocks > hits.num_t0_blocks
        return hits.num_blocks * block_size, tracked.load_async

    def hit_tokens_per_tier(self, request_id: str, num_external_tokens: int) -> tuple[int, int, int]:
        """The leading `num_external_tokens` of the request's last lookup split over T0, T1, and
        the tiers below (T2 and T3: storage, as vLLM's metrics see it)."""
        tracked = self._tracked.get(request_id)
        hits = tracked.hits if tracked is not None else NO_HITS
        split, left = [], num_external_tokens
        for num_blocks in (hits.num_t0_blocks, hits.num_t1_blocks, hits.num_t2_blocks + hits.num_t3_blocks):
            split.append(min(left, num_blocks * self.block_size))
            left -= split[-1]
        split[-1] += left  # tokens the lookup did not attribute (it never happens: they are its hits)
        return split[0], split[1], split[2]

    # ------------------------------------------------------------------ allocation

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Track the request; with external tokens, plan the load into its allocated blocks."""
        tracked = self._tracked.setdefault(request.request_id, _Tracked(request))
        tracked.request = request
        tracked.lookup = None  # consumed: a preempted and resumed request looks up afresh
        if num_external_tokens == 0:
            return
        block_size = self.block_size
        if num_external_tokens % block_size:
            raise ValueError(f"external tokens {num_external_tokens} are not whole blocks of {block_size}")
        first = tracked.num_local_computed_tokens // block_size
        end = first + num_external_tokens // block_size
        block_ids = list(blocks.get_block_ids()[0])
        assert end <= len(block_ids) and end <= len(request.block_hashes), (first, end, len(block_ids))
        self._loads_to_issue[request.request_id] = LoadSpec(
            request.request_id, first, tuple(bytes(h) for h in request.block_hashes[first:end]),
            tuple(request.all_token_ids[first * block_size:end * block_size]), tuple(block_ids[first:end]),
            tracked.load_async)
        tracked.num_offered_blocks = max(tracked.num_offered_blocks, end)  # the daemon holds them

    # ------------------------------------------------------------------ per step

    def build_connector_meta(self, scheduler_output: Any) -> StepMetadata:
        """This step's loads (planned since the last call) and stores; resets the loads."""
        loads = list(self._loads_to_issue.values())
        self._loads_to_issue = {}
        preempted = tuple(sorted(getattr(scheduler_output, "preempted_req_ids", None) or ()))
        for request_id in preempted:
            if request_id in self._tracked:
                self._tracked[request_id].engine_block_ids = []  # resumed requests get a full list
        stores = []
        for request_id, new_block_ids, resumed in scheduled_requests(scheduler_output):
            tracked = self._tracked.get(request_id)
            if tracked is None:
                continue
            if resumed:
                tracked.engine_block_ids = []
            if new_block_ids:
                tracked.engine_block_ids.extend(new_block_ids[0])
            if self.stores_enabled:
                spec = self._store_spec(tracked, scheduler_output.num_scheduled_tokens.get(request_id, 0))
                if spec is not None:
                    stores.append(spec)
        return StepMetadata(loads=loads, stores=stores, preempted_req_ids=preempted)

    def _store_spec(self, tracked: _Tracked, num_scheduled_tokens: int) -> StoreSpec | None:
        request = tracked.request
        block_size = self.block_size
        num_tokens = min(request.num_computed_tokens + num_scheduled_tokens, request.num_tokens)
        num_blocks = min(num_tokens // block_size, len(request.block_hashes), len(tracked.engine_block_ids))
        if num_blocks <= tracked.num_offered_blocks:
            return None
        spec = StoreSpec(request.request_id, tuple(bytes(h) for h in request.block_hashes[:num_blocks]),
                         tuple(request.all_token_ids[:num_blocks * block_size]),
                         tuple(tracked.engine_block_ids[:num_blocks]), num_blocks - tracked.num_offered_blocks)
        tracked.num_offered_blocks = num_blocks
        tracked.has_stores = True
        return spec

    def request_finished(self, request: Any, block_ids: Sequence[int]) -> tuple[bool, dict | None]:
        """(True: keep the blocks until the worker reports the stores done, None)."""
        tracked = self._tracked.pop(request.request_id, None)
        self._loads_to_issue.pop(request.request_id, None)
        return (tracked is not None and tracked.has_stores), None

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def scheduled_requests(scheduler_output: Any) -> Iterator[tuple[str, Sequence[Sequence[int]] | None, bool]]:
    """(request id, new block ids per kv cache group or None, resumed from preemption) of every
    scheduled request. Reads `scheduled_new_reqs[i].req_id / .block_ids` and
    `scheduled_cached_reqs.req_ids / .new_block_ids / .resumed_req_ids` (vllm/v1/core/sched/
    output.py; older releases have `resumed_from_preemption`, a list of bools)."""
    for new in scheduler_output.scheduled_new_reqs:
        yield new.req_id, new.block_ids, False
    cached = scheduler_output.scheduled_cached_reqs
    if cached is None:
        return
    resumed_ids = getattr(cached, "resumed_req_ids", None)
    if resumed_ids is None:
        flags = list(getattr(cached, "resumed_from_preemption", None) or [False] * len(cached.req_ids))
    else:
        flags = [request_id in resumed_ids for request_id in cached.req_ids]
    yield from zip(cached.req_ids, cached.new_block_ids, flags)
