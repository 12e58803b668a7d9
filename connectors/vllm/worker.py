"""The worker side of the vLLM connector: bytes between the engine's KV caches and the pool.

Call order within one engine step on a worker (vllm/v1/worker/kv_connector_model_runner_mixin.py,
`_get_kv_connector_output`): `bind_connector_metadata(meta)`, `start_load_kv(forward_context)`,
the forward (attention layers call `wait_for_layer_load` and `save_kv_layer`), `wait_for_save()`,
`get_finished(scheduler_output.finished_req_ids)`, `get_block_ids_with_load_errors()`,
`clear_connector_metadata()`. `handle_preemptions(req_ids)` comes before a preempted request's
blocks are reused (base.py).

Load (in `start_load_kv`): Acquire the blocks' hashes under a one-off daemon request id (pins
T0 hits; T1/T2 hits are promoted, so Wait), scatter the ready pool blocks into the engine
blocks, Release once the copy has finished reading the pool (after a CUDA event, on the
background thread). A synchronous load runs there and then, before the forward; an
asynchronous one (`LoadSpec.is_async`) runs on the load thread while the engine goes on, and
`get_finished` reports its request in `finished_recving` once its copy has landed. Engine
blocks that could not be filled (the daemon is down, evicted a block since the lookup, a
promotion failed or timed out) are reported by `get_block_ids_with_load_errors()` in the same
step (for an asynchronous load: the step that reports it finished), and vLLM recomputes them
under `kv_load_failure_policy="recompute"`.

Store (started in `wait_for_save`, after the forward wrote the step's KV): a job per StoreSpec
on one background thread: Acquire the chain (hits first, then fresh blocks), gather the engine
blocks of the fresh ones into the pool (on CUDA: on a side stream that waits for an event
recorded after the forward), Commit them with their hashes and tokens (parent: the previous
block's hash, or the root for block 0), Release. A failure drops the store, with a log line.
A request that ever had a store is reported in `finished_sending` by `get_finished` once it has
finished and all its jobs are done: until then vLLM keeps its blocks, so the bytes a job reads
cannot be overwritten.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import threading
from collections.abc import Sequence
from typing import Protocol

import torch

from kvtierd.client import Session
from kvtierd.connectors.vllm.daemon_link import DaemonLink
from kvtierd.connectors.vllm.metadata import LoadSpec, StepMetadata, StoreSpec
from kvtierd.errors import KvtierError

log = logging.getLogger(__name__)


class EngineBlocks(Protocol):
    """The engine's KV blocks as the worker moves them (engine_blocks.PagedLayers)."""

    device: torch.device

    def to_pool(self, engine_block_ids: Sequence[int], pool: torch.Tensor,
                pool_block_ids: Sequence[int]) -> None: ...

    def from_pool(self, pool: torch.Tensor, pool_block_ids: Sequence[int],
                  engine_block_ids: Sequence[int]) -> None: ...


class WorkerSide:
    """Loads and stores of one worker.

    Invariants: `_jobs[r]` holds the futures of request r's store and release jobs not yet
    reported; `_requests_with_stores` are the requests that ever had a StoreSpec (exactly those
    the scheduler delays), each reported once in `finished_sending`, after vLLM has named it
    finished and its jobs are done; `_load_error_block_ids` is drained by each report.
    """

    def __init__(self, link: DaemonLink, *, wait_timeout_s: float = 30.0) -> None:
        self.link = link
        self.wait_timeout_s = wait_timeout_s
        self.engine: EngineBlocks | None = None
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvtierd-store")
        self._load_executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvtierd-load")
        self._async_loads: dict[str, concurrent.futures.Future] = {}  # request id -> its load (main thread only)
        self._daemon_request_ids = itertools.count()
        self._lock = threading.Lock()  # guards the three fields below (the store thread appends stats)
        self._jobs: dict[str, list[concurrent.futures.Future]] = {}
        self._requests_with_stores: set[str] = set()
        self._finished_waiting: set[str] = set()
        self._load_error_block_ids: set[int] = set()
        self._side_stream = None
        self.num_loaded_blocks = 0
        self.num_stored_blocks = 0

    def register(self, engine: EngineBlocks) -> None:
        self.engine = engine
        if engine.device.type == "cuda":
            self._side_stream = torch.cuda.Stream(device=engine.device)

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
        """Load what can be loaded; returns the engine block ids left unfilled."""
        assert self.engine is not None, "load before register_kv_caches"
        session = self.link.session()
        if session is None:
            return set(spec.engine_block_ids)
        daemon_request_id = self._daemon_request_id("load", spec.request_id)
        try:
            acquired = session.acquire(daemon_request_id, list(spec.block_hashes), 0, token_ids=list(spec.token_ids))
        except KvtierError as error:
            self.link.failed(session, error)
            log.warning("kvtierd connector: acquire for loading %s failed (%s: %s)", spec.request_id,
                        type(error).__name__, error)
            return set(spec.engine_block_ids)
        num_ready = acquired.num_t0_hit_blocks
        if acquired.pending:
            try:
                num_ready = session.wait(daemon_request_id, timeout_s=self.wait_timeout_s)
            except KvtierError as error:
                self.link.failed(session, error)
                log.warning("kvtierd connector: promotion for %s failed (%s: %s)", spec.request_id,
                            type(error).__name__, error)
        num_hits = acquired.num_t0_hit_blocks + acquired.num_loading_blocks
        num_ready = max(0, min(num_ready, num_hits, spec.num_blocks))
        event = None
        try:
            if num_ready:
                self.engine.from_pool(session.pool.tensor, acquired.block_ids[:num_ready],
                                      spec.engine_block_ids[:num_ready])
                event = self._record_event()
                if spec.is_async and event is not None:
                    event.synchronize()  # landed before finished_recving names the request
        except Exception as error:  # a bad copy must not kill the engine: recompute instead
            log.warning("kvtierd connector: copying %s from the pool failed: %r", spec.request_id, error)
            num_ready = 0
        self._submit(spec.request_id, self._release_after, session, daemon_request_id, event)
        self.num_loaded_blocks += num_ready
        return set(spec.engine_block_ids[num_ready:])

    def take_load_error_block_ids(self) -> set[int]:
        errors, self._load_error_block_ids = self._load_error_block_ids, set()
        return errors

    # ------------------------------------------------------------------ stores

    def start_stores(self, metadata: StepMetadata) -> None:
        """Queue every StoreSpec; the copies start once the forward's writes have landed."""
        if not metadata.stores:
            return
        assert self.engine is not None, "store before register_kv_caches"
        event = self._record_event()
        for spec in metadata.stores:
            with self._lock:
                self._requests_with_stores.add(spec.request_id)
            self._submit(spec.request_id, self._store, spec, event)

    def _store(self, spec: StoreSpec, event) -> None:
        session = self.link.session()
        if session is None:
            return
        daemon_request_id = self._daemon_request_id("store", spec.request_id)
        try:
            acquired = session.acquire(daemon_request_id, list(spec.block_hashes), 0, token_ids=list(spec.token_ids))
        except KvtierError as error:
            self.link.failed(session, error)
            log.warning("kvtierd connector: no store for %s (%s: %s)", spec.request_id, type(error).__name__, error)
            return
        try:
            num_hits = acquired.num_t0_hit_blocks + acquired.num_loading_blocks
            fresh_block_ids = acquired.block_ids[num_hits:spec.num_blocks]
            if fresh_block_ids:
                self._copy_to_pool(spec.engine_block_ids[num_hits:], session.pool.tensor, fresh_block_ids, event)
                block_size = len(spec.token_ids) // spec.num_blocks
                session.commit(daemon_request_id, fresh_block_ids, list(spec.block_hashes[num_hits:]),
                               list(spec.token_ids[num_hits * block_size:]),
                               spec.block_hashes[num_hits - 1] if num_hits else None)
                self.num_stored_blocks += len(fresh_block_ids)
        except Exception as error:  # KvtierError or a failed copy: the store is dropped
            if isinstance(error, KvtierError):
                self.link.failed(session, error)
            log.warning("kvtierd connector: store of %s dropped (%s: %s)", spec.request_id,
                        type(error).__name__, error)
        finally:
            self._release_after(session, daemon_request_id, None)

    def _copy_to_pool(self, engine_block_ids, pool: torch.Tensor, pool_block_ids, event) -> None:
        if self._side_stream is None:
            self.engine.to_pool(engine_block_ids, pool, pool_block_ids)
            return
        with torch.cuda.stream(self._side_stream):
            if event is not None:
                self._side_stream.wait_event(event)
            self.engine.to_pool(engine_block_ids, pool, pool_block_ids)
        self._side_stream.synchronize()  # the bytes are in the pool before Commit shares them

    # ------------------------------------------------------------------ completion

    def _record_event(self):
        """A CUDA event after the work queued so far on the current stream (None on CPU)."""
        if self.engine is None or self.engine.device.type != "cuda":
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

    def _submit(self, request_id: str, fn, *args) -> None:
        future = self._executor.submit(fn, *args)
        with self._lock:
            self._jobs.setdefault(request_id, []).append(future)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(finished requests whose stores are all done, requests whose asynchronous loads are done)."""
        finished_loads = self._finished_loads()
        with self._lock:
            self._finished_waiting |= finished_req_ids & self._requests_with_stores
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
        self._executor.shutdown(wait=True)
        self.link.close()
