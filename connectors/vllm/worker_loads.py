"""The load side of a vLLM worker: the daemon's pool blocks into the engine's KV pages, group by group.

In `start_load_kv` (worker.py), per group of the LoadSpec: Acquire its chain under a one-off daemon
request id (pins T0 hits; T1/T2 hits are promoted, so Wait; the scheduler's Lookup decided what is
worth loading and held it, so the Acquire loads every hit: `load_every_hit`, and the primary group's
names the Lookup's `hold_id`), copy the ready pool blocks into the group's engine blocks, Release
once the copy has finished reading the pool (after a CUDA event, on the store thread: worker_jobs.py).
A synchronous load runs there and then, before the forward; an asynchronous one (`LoadSpec.is_async`)
runs on the load thread while the engine goes on, and `get_finished` reports its request in
`finished_recving` once its copies have landed. Engine blocks that could not be filled (the daemon
is down, a block past the lookup's hold was evicted, a promotion failed or timed out) are reported
by `get_block_ids_with_load_errors()` in the same step (for an asynchronous load: the step that
reports it finished), and vLLM recomputes them under `kv_load_failure_policy="recompute"`.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging

from kvtierd.client import Session
from kvtierd.connectors.daemon_link import DaemonLink, mapped_pool
from kvtierd.connectors.prefill_cost import PrefillCost
from kvtierd.connectors.vllm.connector_stats import StatsRecorder
from kvtierd.connectors.vllm.engine_pages import EnginePagesLike
from kvtierd.connectors.vllm.kv_groups import ServedGroup
from kvtierd.connectors.vllm.metadata import GroupBlocks, LoadSpec, StepMetadata
from kvtierd.connectors.vllm.worker_jobs import RequestJobs, record_event, release_after
from kvtierd.errors import KvtierError
from kvtierd.tier import TierCounts

log = logging.getLogger(__name__)


class WorkerLoads:
    """The loads of one worker.

    Invariants: `_async_loads` holds the asynchronous loads not yet reported (mutated by vLLM's worker
    thread only); `_load_error_block_ids` is drained by each report.
    """

    def __init__(self, link: DaemonLink, groups: dict[int, ServedGroup], primary_group_id: int, jobs: RequestJobs,
                 stats: StatsRecorder, prefill_cost: PrefillCost, *, release_executor: concurrent.futures.Executor,
                 wait_timeout_s: float, counts_tokens: bool) -> None:
        self.link = link
        self._groups = groups
        self._primary_group_id = primary_group_id  # its Acquire names the Lookup's hold
        self._jobs = jobs
        self.stats = stats
        self.prefill_cost = prefill_cost  # reported on Acquires
        self._release_executor = release_executor  # the Releases run in order with the stores (worker.py)
        self.wait_timeout_s = wait_timeout_s
        self.counts_tokens = counts_tokens  # False on TP ranks > 0: rank 0 counts the tokens they share
        self.pages: EnginePagesLike | None = None
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvtierd-load")
        self._async_loads: dict[str, concurrent.futures.Future] = {}  # request id -> its load
        self._daemon_request_ids = itertools.count()
        self._load_error_block_ids: set[int] = set()
        self.num_loaded_blocks = 0

    def start(self, metadata: StepMetadata) -> None:
        """Fill every synchronous LoadSpec's engine blocks now and start the asynchronous ones;
        failures become load errors."""
        for spec in metadata.loads:
            if spec.is_async:
                assert spec.request_id not in self._async_loads, f"{spec.request_id} loads twice"
                self._async_loads[spec.request_id] = self._executor.submit(self._load_in_background, spec)
            else:
                self._report(spec, self._load(spec))

    def take_finished(self) -> set[str]:
        """Requests whose asynchronous loads are done (their failures now in the load errors)."""
        done = {request_id for request_id, future in self._async_loads.items() if future.done()}
        for request_id in done:
            spec, failed = self._async_loads.pop(request_id).result()
            self._report(spec, failed)
        return done

    def take_load_error_block_ids(self) -> set[int]:
        errors, self._load_error_block_ids = self._load_error_block_ids, set()
        return errors

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True)

    def _report(self, spec: LoadSpec, failed: set[int]) -> None:
        if failed:
            log.warning("kvtierd connector: %d of %d blocks of %s not loaded; vLLM recomputes them",
                        len(failed), spec.num_blocks, spec.request_id)
            self._load_error_block_ids.update(failed)

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
            group_failed, ready_blocks = self._load_group(session, self.pages, spec, blocks)
            failed |= group_failed
            if blocks.num_blocks == max(g.num_blocks for g in spec.groups):  # a group that loads the whole hit
                loaded_blocks, block_size = ready_blocks, len(blocks.token_ids) // blocks.num_blocks
        if self.counts_tokens:
            self.stats.add_loaded_tokens(loaded_blocks, block_size)
        self.stats.add("failed_load_blocks", len(failed))
        return failed

    def _load_group(self, session: Session, pages: EnginePagesLike, spec: LoadSpec,
                    blocks: GroupBlocks) -> tuple[set[int], TierCounts]:
        """(the engine block ids left unfilled, the blocks filled per tier)."""
        daemon_request_id = f"vllm-load-{spec.request_id}-{next(self._daemon_request_ids)}"
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
                pages.from_pool(self._groups[blocks.group_id], mapped_pool(session),
                                acquired.block_ids[:num_ready], blocks.engine_block_ids[:num_ready])
                event = record_event(pages)
                if spec.is_async and event is not None:
                    event.synchronize()  # landed before finished_recving names the request
        except Exception as error:  # a bad copy must not kill the engine: recompute instead
            log.warning("kvtierd connector: copying %s from the pool failed: %r", spec.request_id, error)
            num_ready = 0
        self._jobs.submit(spec.request_id, self._release_executor, release_after, self.link, session,
                          daemon_request_id, event)
        self.num_loaded_blocks += num_ready
        self.stats.add("loaded_bytes", num_ready * self._groups[blocks.group_id].block_nbytes)
        # The ready blocks are the hit's first: T0's hits, then each lower tier's (the chain's order).
        return set(blocks.engine_block_ids[num_ready:]), acquired.tier_blocks.first(num_ready)
