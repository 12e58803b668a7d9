"""The worker side of the vLLM connector: bytes between the engine's KV pages and the pool, group by group.

Call order within one engine step on a worker (vllm/v1/worker/gpu_model_runner.py `execute_model`
and kv_connector_model_runner_mixin.py `_get_kv_connector_output`): `handle_preemptions(meta)`
(before anything of the step touches a block: vLLM zeroes and reuses freed blocks right after),
`bind_connector_metadata(meta)`, `start_load_kv(forward_context)`, the forward,
`wait_for_save()`, `get_finished(scheduler_output.finished_req_ids)`,
`get_block_ids_with_load_errors()`, `clear_connector_metadata()`.

Load (in `start_load_kv`): per group of the LoadSpec, Acquire its chain under a one-off daemon
request id (pins T0 hits; T1/T2 hits are promoted, so Wait; the scheduler's Lookup decided what is
worth loading and held it, so the Acquire loads every hit: `load_every_hit`, and the primary group's
names the Lookup's `hold_id`), copy the ready pool blocks into the group's engine blocks, Release
once the copy has finished reading the pool (after a CUDA event, on the background thread). A
synchronous load runs there and then, before the forward; an asynchronous one (`LoadSpec.is_async`)
runs on the load thread while the engine goes on, and `get_finished` reports its request in
`finished_recving` once its copies have landed. Engine blocks that could not be filled (the daemon
is down, a block past the lookup's hold was evicted, a promotion failed or timed out) are reported
by `get_block_ids_with_load_errors()` in the same step (for an asynchronous load: the step that
reports it finished), and vLLM recomputes them under `kv_load_failure_policy="recompute"`.

Store (started in `wait_for_save`, after the forward wrote the step's KV): a job per GroupStore:
Acquire its blocks (the parent stored before, then the step's new blocks: hits first, then fresh
blocks), copy the engine pages of the fresh ones into the pool (on CUDA: on a side stream that waits
for an event recorded after the forward), Commit them with their hashes and tokens (parent: the
previous block's hash, or the root for a chain's first block) and release the request in the same
call: two RPCs carrying the new blocks and one more, never the request's whole chain (a separate
Release only where the store stops before its Commit, or for a daemon that predates releasing on
Commit). A daemon that lost the parent gets the chain from position 0 when the offer carries it
(`earlier`), else the store is dropped. A failure drops the store, logged and counted
(`num_dropped_stores`); a later request with the same prefix stores it again (`stats` counts what
stores sent). Full-attention pages stay the request's until vLLM frees them: a request that ever had
a store is reported in `finished_sending` once it has finished and all its jobs are done.
Sliding-window and Mamba pages (`volatile`) are freed by vLLM's next schedule and may be rewritten
by the next step, so their jobs run on a thread of their own and the next step's
`handle_preemptions` waits until they have read their pages. A worker that is not its layout's
writer (a TP replica of KV another rank stores: MLA) stores nothing but still reports its requests.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import threading
from collections.abc import Sequence

import torch

from kvtierd.client import Session
from kvtierd.connectors.prefill_cost import PrefillCost
from kvtierd.connectors.vllm.connector_stats import StatsRecorder, request_payload_nbytes
from kvtierd.connectors.vllm.daemon_link import DaemonLink
from kvtierd.connectors.vllm.engine_pages import EnginePagesLike
from kvtierd.connectors.vllm.group_hits import primary_group
from kvtierd.connectors.vllm.kv_groups import EngineGroups, ServedGroup
from kvtierd.connectors.vllm.metadata import GroupBlocks, GroupStore, LoadSpec, StepMetadata, StoreSpec
from kvtierd.connectors.vllm.retention_calls import RetentionCalls
from kvtierd.errors import KvtierError
from kvtierd.tier import TierCounts

log = logging.getLogger(__name__)

DEFAULT_START_ATTACH_S = 10.0  # the longest an engine's start waits for its first Attach


class WorkerSide:
    """Loads and stores of one worker.

    Invariants: `_jobs[r]` holds the futures of request r's store and release jobs not yet
    reported; `_requests_with_stores` are the requests that ever had a StoreSpec (exactly those
    the scheduler delays), each reported once in `finished_sending`, after vLLM has named it
    finished and its jobs are done; `_load_error_block_ids` is drained by each report;
    `_volatile_reads` are the events of volatile stores whose pages may not have been read yet.
    """

    def __init__(self, link: DaemonLink, engine_groups: EngineGroups, *, wait_timeout_s: float = 30.0,
                 writes: bool = True, start_attach_s: float = DEFAULT_START_ATTACH_S,
                 counts_tokens: bool = True, prefill_cost: PrefillCost | None = None) -> None:
        assert start_attach_s > 0, start_attach_s  # the connector refuses a bad setting in one line
        self.link = link
        self.start_attach_s = start_attach_s
        self.engine_groups = engine_groups
        self._groups = {group.group_id: group for group in engine_groups.groups}
        self._primary_group_id = engine_groups.groups[primary_group(engine_groups.groups)].group_id  # holds: lookups
        self.wait_timeout_s = wait_timeout_s
        self.writes = writes  # False: a TP replica whose KV another rank stores
        self.pages: EnginePagesLike | None = None
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvtierd-store")
        self._volatile_executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvtierd-store-window")
        self._load_executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvtierd-load")
        self._async_loads: dict[str, concurrent.futures.Future] = {}  # request id -> its load (main thread only)
        self._daemon_request_ids = itertools.count()
        self._lock = threading.Lock()  # guards the fields below (the store threads append)
        self._jobs: dict[str, list[concurrent.futures.Future]] = {}
        self._requests_with_stores: set[str] = set()
        self._finished_waiting: set[str] = set()
        self._load_error_block_ids: set[int] = set()
        self._volatile_reads: list[threading.Event] = []
        self._side_stream = None
        self.num_loaded_blocks = self.num_stored_blocks = self.num_dropped_stores = 0
        self.stats = StatsRecorder()  # for vLLM's connector metrics (connector_stats.py)
        self.retention = RetentionCalls(link, self.stats, engine_groups.block_size)  # hints (retention_calls.py)
        self.prefill_cost = prefill_cost or PrefillCost(engine_groups.block_size)  # reported on Acquires
        self.counts_tokens = counts_tokens  # False on TP ranks > 0: rank 0 counts the tokens they share

    def register(self, pages: EnginePagesLike) -> None:
        """Take the engine's pages and attach, waiting at most `start_attach_s`: vLLM registers its
        KV caches before the engine serves, and the first forward that follows may hold the GIL for
        seconds (torch.compile of vLLM's CPU helpers), during which a gRPC call from another thread
        of this process barely progresses. A daemon that does not answer by then is attached later,
        by the first store that finds the retry due; a synchronous load never waits for an Attach
        (it fails over to recompute instead)."""
        self.pages = pages
        if pages.device.type == "cuda":
            self._side_stream = torch.cuda.Stream(device=pages.device)
        self.link.session(deadline_s=self.start_attach_s)

    def _pages(self) -> EnginePagesLike:
        assert self.pages is not None, "a load or store before register_kv_caches"
        return self.pages

    @staticmethod
    def _pool(session: Session) -> torch.Tensor:
        assert session.pool is not None, "a worker's session maps the pool (DaemonLink map_pool)"
        return session.pool.tensor

    def _daemon_request_id(self, kind: str, request_id: str) -> str:
        return f"vllm-{kind}-{request_id}-{next(self._daemon_request_ids)}"

    # ------------------------------------------------------------------ loads

    def start_load(self, metadata: StepMetadata) -> None:
        """Fill every synchronous LoadSpec's engine blocks now and start the asynchronous ones;
        failures become load errors."""
        for spec in metadata.loads:
            if spec.is_async:
                assert spec.request_id not in self._async_loads, f"{spec.request_id} loads twice"
                self._async_loads[spec.request_id] = self._load_executor.submit(self._load_in_background, spec)
            else:
                self._report_load(spec, self._load(spec))

    def _report_load(self, spec: LoadSpec, failed: set[int]) -> None:
        if failed:
            log.warning("kvtierd connector: %d of %d blocks of %s not loaded; vLLM recomputes them",
                        len(failed), spec.num_blocks, spec.request_id)
            self._load_error_block_ids.update(failed)

    def _finished_loads(self) -> set[str]:
        """Requests whose asynchronous loads are done (their failures now in the load errors)."""
        done = {request_id for request_id, future in self._async_loads.items() if future.done()}
        for request_id in done:
            spec, failed = self._async_loads.pop(request_id).result()
            self._report_load(spec, failed)
        return done

    def _load_in_background(self, spec: LoadSpec) -> tuple[LoadSpec, set[int]]:
        """`_load` on the load thread: (the spec, the engine block ids left unfilled), always."""
        try:
            return spec, self._load(spec)
        except Exception as error:  # never lose the report: vLLM would wait for it forever
            log.warning("kvtierd connector: background load of %s failed: %r", spec.request_id, error)
            return spec, set(spec.engine_block_ids)

    def _load(self, spec: LoadSpec) -> set[int]:
        """Load what can be loaded, group by group; returns the engine block ids left unfilled."""
        assert self.pages is not None, "load before register_kv_caches"
        session = self.link.session(attach=spec.is_async)
        if session is None:
            return set(spec.engine_block_ids)
        failed: set[int] = set()
        loaded_blocks, block_size = TierCounts(), 0
        for blocks in spec.groups:
            group_failed, ready_blocks = self._load_group(session, spec, blocks)
            failed |= group_failed
            if blocks.num_blocks == max(g.num_blocks for g in spec.groups):  # a group that loads the whole hit
                loaded_blocks, block_size = ready_blocks, len(blocks.token_ids) // blocks.num_blocks
        if self.counts_tokens:
            self.stats.add_loaded_tokens(loaded_blocks, block_size)
        self.stats.add("failed_load_blocks", len(failed))
        return failed

    def _load_group(self, session: Session, spec: LoadSpec,
                    blocks: GroupBlocks) -> tuple[set[int], TierCounts]:
        """(the engine block ids left unfilled, the blocks filled per tier)."""
        daemon_request_id = self._daemon_request_id("load", spec.request_id)
        try:
            acquired = session.acquire(daemon_request_id, list(blocks.block_hashes), 0,
                                       token_ids=list(blocks.token_ids), query_counted=True, load_every_hit=True,
                                       recompute_s_per_token=self.prefill_cost.s_per_token,
                                       hold_id=spec.request_id if blocks.group_id == self._primary_group_id else "")
        except KvtierError as error:
            self.link.failed(session, error)
            log.warning("kvtierd connector: acquire for loading %s failed (%s: %s)", spec.request_id,
                        type(error).__name__, error)
            return set(blocks.engine_block_ids), TierCounts()
        num_ready = acquired.num_t0_hit_blocks
        if acquired.pending:
            try:
                num_ready = session.wait(daemon_request_id, timeout_s=self.wait_timeout_s)
            except KvtierError as error:
                self.link.failed(session, error)
                log.warning("kvtierd connector: promotion for %s failed (%s: %s)", spec.request_id,
                            type(error).__name__, error)
        num_hits = acquired.num_t0_hit_blocks + acquired.num_loading_blocks
        num_ready = max(0, min(num_ready, num_hits, blocks.num_blocks))
        event = None
        try:
            if num_ready:
                self._pages().from_pool(self._groups[blocks.group_id], self._pool(session),
                                     acquired.block_ids[:num_ready], blocks.engine_block_ids[:num_ready])
                event = self._record_event()
                if spec.is_async and event is not None:
                    event.synchronize()  # landed before finished_recving names the request
        except Exception as error:  # a bad copy must not kill the engine: recompute instead
            log.warning("kvtierd connector: copying %s from the pool failed: %r", spec.request_id, error)
            num_ready = 0
        self._submit(spec.request_id, self._executor, self._release_after, session, daemon_request_id, event)
        self.num_loaded_blocks += num_ready
        self.stats.add("loaded_bytes", num_ready * self._groups[blocks.group_id].block_nbytes)
        # The ready blocks are the hit's first: T0's hits, then each lower tier's (the chain's order).
        return set(blocks.engine_block_ids[num_ready:]), acquired.tier_blocks.first(num_ready)

    def take_load_error_block_ids(self) -> set[int]:
        errors, self._load_error_block_ids = self._load_error_block_ids, set()
        return errors

    # ------------------------------------------------------------------ stores

    def start_stores(self, metadata: StepMetadata) -> None:
        """Queue a job per GroupStore, then the step's Retains (one thread runs the full-attention
        stores and the Retains in that order); the copies start once the forward's writes have landed."""
        assert self.pages is not None or not metadata.stores, "store before register_kv_caches"
        event = self._record_event() if metadata.stores else None
        for spec in metadata.stores:
            with self._lock:
                self._requests_with_stores.add(spec.request_id)
            if not self.writes:
                continue
            for offer in spec.groups:
                if offer.volatile:
                    pages_read = threading.Event()
                    with self._lock:
                        self._volatile_reads.append(pages_read)
                    self._submit(spec.request_id, self._volatile_executor, self._store, spec, offer, event,
                                 pages_read)
                else:
                    self._submit(spec.request_id, self._executor, self._store, spec, offer, event, None)
        for retain in metadata.retains if self.writes else ():
            self._executor.submit(self.retention.retain, retain)

    def _store(self, spec: StoreSpec, offer: GroupStore, event, pages_read: threading.Event | None) -> None:
        """One group's offer; `pages_read` (volatile offers) is set once the engine pages are read or skipped."""
        session = None
        held = True  # the daemon may hold the store's request: released at the end, unless its Commit did
        daemon_request_id = self._daemon_request_id("store", spec.request_id)
        try:
            session = self.link.session()
            if session is None:
                self._count_dropped("the daemon cannot be reached", spec.request_id)
            else:
                held = self._store_with(session, daemon_request_id, spec, offer, event, pages_read)
        except Exception as error:  # KvtierError or a failed copy: the store is dropped
            if isinstance(error, KvtierError) and session is not None:
                self.link.failed(session, error)
            self._count_dropped(f"{type(error).__name__}: {error}", spec.request_id)
        finally:
            if pages_read is not None:
                pages_read.set()
            if session is not None and held:
                self._release_store(session, daemon_request_id)

    def _store_with(self, session: Session, daemon_request_id: str, spec: StoreSpec, offer: GroupStore, event,
                    pages_read: threading.Event | None) -> bool:
        """Acquire, copy, Commit (releasing the request in the same call); whether the daemon still
        holds the request (the caller releases it then)."""
        blocks = offer.blocks
        acquired = self._acquire_to_store(session, daemon_request_id, blocks)
        num_hits = acquired.num_t0_hit_blocks + acquired.num_loading_blocks
        if num_hits < offer.num_known_blocks:  # the daemon no longer holds the parent
            if offer.earlier is None:  # the chain cannot reach this step's blocks
                self._count_dropped(f"the daemon no longer holds block {blocks.first_position} of group "
                                    f"{blocks.group_id}, the parent of this step's blocks", spec.request_id)
                return True
            self._release_store(session, daemon_request_id)
            blocks = offer.earlier.then(blocks)  # vLLM's own cache still has them: store from position 0
            acquired = self._acquire_to_store(session, daemon_request_id, blocks)
            num_hits = acquired.num_t0_hit_blocks + acquired.num_loading_blocks
        fresh_block_ids = acquired.block_ids[num_hits:blocks.num_blocks]
        if not fresh_block_ids:
            return True
        assert num_hits or blocks.first_position == 0 or offer.volatile, "a mid-chain commit needs its parent"
        self._copy_to_pool(self._groups[blocks.group_id], blocks.engine_block_ids[num_hits:], self._pool(session),
                           fresh_block_ids, event)
        if pages_read is not None:
            pages_read.set()
        block_size = len(blocks.token_ids) // blocks.num_blocks
        hashes, tokens = list(blocks.block_hashes[num_hits:]), list(blocks.token_ids[num_hits * block_size:])
        committed = self.retention.commit_and_release(session, spec.request_id, spec.retention, daemon_request_id,
                                                      blocks, num_hits, fresh_block_ids,
                                                      blocks.block_hashes[num_hits - 1] if num_hits else None)
        self._count_store_rpcs(1, hashes, tokens)
        self.num_stored_blocks += len(fresh_block_ids)
        self.stats.add("stored_blocks", len(fresh_block_ids))
        self.stats.add("stored_bytes", len(fresh_block_ids) * self._groups[blocks.group_id].block_nbytes)
        return not committed.released

    def _acquire_to_store(self, session: Session, daemon_request_id: str, blocks: GroupBlocks):
        """Acquire `blocks` to store them (no hit, no query); counted in `stats`."""
        hashes, tokens = list(blocks.block_hashes), list(blocks.token_ids)
        acquired = session.acquire(daemon_request_id, hashes, 0, token_ids=tokens, for_store=True,
                                   recompute_s_per_token=self.prefill_cost.s_per_token)
        self._count_store_rpcs(1, hashes, tokens)
        return acquired

    def _release_store(self, session: Session, daemon_request_id: str) -> None:
        """Release a store's request (one its Commit did not release), counted in `stats`."""
        self._count_store_rpcs(1, (), ())
        self._release_after(session, daemon_request_id, None)

    def _count_store_rpcs(self, num_rpcs: int, block_hashes: Sequence[bytes], token_ids: Sequence[int]) -> None:
        self.stats.add("store_rpcs", num_rpcs)
        self.stats.add("store_request_bytes", request_payload_nbytes(block_hashes, token_ids))

    def _count_dropped(self, why: str, request_id: str) -> None:
        """Count a dropped store; log the first and then every 100th (a daemon that is down drops many)."""
        self.stats.add("dropped_stores", 1)
        with self._lock:
            self.num_dropped_stores += 1
            count = self.num_dropped_stores
        if count == 1 or count % 100 == 0:
            log.warning("kvtierd connector: a store of %s was dropped (%s); %d dropped on this rank so far, a "
                        "later request with the same prefix stores it", request_id, why, count)

    def _copy_to_pool(self, group: ServedGroup, engine_block_ids, pool: torch.Tensor, pool_block_ids, event) -> None:
        pages = self._pages()
        if self._side_stream is None:
            pages.to_pool(group, engine_block_ids, pool, pool_block_ids)
            return
        with torch.cuda.stream(self._side_stream):
            if event is not None:
                self._side_stream.wait_event(event)
            pages.to_pool(group, engine_block_ids, pool, pool_block_ids)
        self._side_stream.synchronize()  # the bytes are in the pool before Commit shares them

    def wait_for_volatile_reads(self) -> None:
        """Block until every volatile store queued so far has read its engine pages (vLLM is about
        to free, zero and reuse sliding-window and Mamba blocks)."""
        with self._lock:
            pending, self._volatile_reads = self._volatile_reads, []
        for pages_read in pending:
            pages_read.wait()

    # ------------------------------------------------------------------ completion

    def _record_event(self):
        """A CUDA event after the work queued so far on the current stream (None on CPU)."""
        if self.pages is None or self.pages.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def _release_after(self, session: Session, daemon_request_id: str, event) -> None:
        if event is not None:
            event.synchronize()  # the copy has read the pool blocks
        try:
            session.release(daemon_request_id)
        except KvtierError as error:
            self.link.failed(session, error)
            log.warning("kvtierd connector: release of %s failed (%s: %s); the daemon reclaims it with "
                        "the session", daemon_request_id, type(error).__name__, error)

    def _submit(self, request_id: str, executor: concurrent.futures.Executor, fn, *args) -> None:
        future = executor.submit(fn, *args)
        with self._lock:
            self._jobs.setdefault(request_id, []).append(future)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(finished requests whose stores are all done, requests whose asynchronous loads are done)."""
        finished_loads = self._finished_loads()
        with self._lock:
            self._finished_waiting |= finished_req_ids & self._requests_with_stores
            self.retention.forget(finished_req_ids)
            for request_id in finished_req_ids - self._requests_with_stores:
                self._jobs.pop(request_id, None)  # load releases only: nobody waits for them
            for request_id, futures in self._jobs.items():
                futures[:] = [f for f in futures if not f.done()]
            done = {r for r in self._finished_waiting if not self._jobs.get(r)}
            for request_id in done:
                self._finished_waiting.discard(request_id)
                self._requests_with_stores.discard(request_id)
                self._jobs.pop(request_id, None)
        return (done or None), (finished_loads or None)

    def wait_for_requests(self, request_ids: set[str]) -> None:
        """Block until the jobs of `request_ids` are done (their blocks are about to be reused)."""
        with self._lock:
            futures = [f for r in request_ids for f in self._jobs.get(r, ())]
        concurrent.futures.wait(futures)

    def shutdown(self) -> None:
        self._load_executor.shutdown(wait=True)
        self._volatile_executor.shutdown(wait=True)
        self._executor.shutdown(wait=True)
        self.link.close()
