"""The store side of a vLLM worker: the engine's KV pages of the step's new blocks into the daemon's pool.

Started in `wait_for_save` (worker.py), after the forward wrote the step's KV: a job per GroupStore:
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
a store is reported in `finished_sending` once it has finished and all its jobs are done
(worker_jobs.py). Sliding-window and Mamba pages (`volatile`) are freed by vLLM's next schedule and
may be rewritten by the next step, so their jobs run on a thread of their own and the next step's
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
from kvtierd.connectors.daemon_link import DaemonLink, mapped_pool
from kvtierd.connectors.prefill_cost import PrefillCost
from kvtierd.connectors.vllm.connector_stats import StatsRecorder, request_payload_nbytes
from kvtierd.connectors.vllm.engine_pages import EnginePagesLike
from kvtierd.connectors.vllm.kv_groups import ServedGroup
from kvtierd.connectors.vllm.metadata import GroupBlocks, GroupStore, StepMetadata, StoreSpec
from kvtierd.connectors.vllm.retention_calls import RetentionCalls
from kvtierd.connectors.vllm.worker_jobs import RequestJobs, record_event, release_after
from kvtierd.errors import KvtierError

log = logging.getLogger(__name__)


class WorkerStores:
    """The stores of one worker.

    Invariants: `_volatile_reads` are the events of volatile stores whose pages may not have been read
    yet; `num_dropped_stores` counts this rank's dropped stores (both guarded by `_lock`: the store
    threads append and count).
    """

    def __init__(self, link: DaemonLink, groups: dict[int, ServedGroup], jobs: RequestJobs, stats: StatsRecorder,
                 retention: RetentionCalls, prefill_cost: PrefillCost, *, executor: concurrent.futures.Executor,
                 writes: bool) -> None:
        self.link = link
        self._groups = groups
        self._jobs = jobs
        self.stats = stats
        self.retention = retention
        self.prefill_cost = prefill_cost  # reported on Acquires
        self._executor = executor  # the full-attention stores and the Retains, in order (worker.py)
        self._volatile_executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvtierd-store-window")
        self.writes = writes  # False: a TP replica whose KV another rank stores
        self.pages: EnginePagesLike | None = None
        self._side_stream: torch.cuda.Stream | None = None
        self._daemon_request_ids = itertools.count()
        self._lock = threading.Lock()
        self._volatile_reads: list[threading.Event] = []
        self.num_stored_blocks = self.num_dropped_stores = 0

    def register(self, pages: EnginePagesLike) -> None:
        self.pages = pages
        if pages.device.type == "cuda":
            self._side_stream = torch.cuda.Stream(device=pages.device)

    def start(self, metadata: StepMetadata) -> None:
        """Queue a job per GroupStore, then the step's Retains (one thread runs the full-attention
        stores and the Retains in that order); the copies start once the forward's writes have landed."""
        assert self.pages is not None or not metadata.stores, "store before register_kv_caches"
        event = record_event(self.pages) if metadata.stores else None
        for spec in metadata.stores:
            self._jobs.expect_stores(spec.request_id)
            if not self.writes:
                continue
            for offer in spec.groups:
                if offer.volatile:
                    pages_read = threading.Event()
                    with self._lock:
                        self._volatile_reads.append(pages_read)
                    self._jobs.submit(spec.request_id, self._volatile_executor, self._store, spec, offer, event,
                                      pages_read)
                else:
                    self._jobs.submit(spec.request_id, self._executor, self._store, spec, offer, event, None)
        for retain in metadata.retains if self.writes else ():
            self._executor.submit(self.retention.retain, retain)

    def wait_for_volatile_reads(self) -> None:
        """Block until every volatile store queued so far has read its engine pages (vLLM is about
        to free, zero and reuse sliding-window and Mamba blocks)."""
        with self._lock:
            pending, self._volatile_reads = self._volatile_reads, []
        for pages_read in pending:
            pages_read.wait()

    def shutdown(self) -> None:
        self._volatile_executor.shutdown(wait=True)

    def _store(self, spec: StoreSpec, offer: GroupStore, event: torch.cuda.Event | None,
               pages_read: threading.Event | None) -> None:
        """One group's offer; `pages_read` (volatile offers) is set once the engine pages are read or skipped."""
        session = None
        held = True  # the daemon may hold the store's request: released at the end, unless its Commit did
        daemon_request_id = f"vllm-store-{spec.request_id}-{next(self._daemon_request_ids)}"
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
                self._release(session, daemon_request_id)

    def _store_with(self, session: Session, daemon_request_id: str, spec: StoreSpec, offer: GroupStore,
                    event: torch.cuda.Event | None, pages_read: threading.Event | None) -> bool:
        """Acquire, copy, Commit (releasing the request in the same call); whether the daemon still
        holds the request (the caller releases it then)."""
        blocks = offer.blocks
        acquired = self._acquire(session, daemon_request_id, blocks)
        num_hits = acquired.num_t0_hit_blocks + acquired.num_loading_blocks
        if num_hits < offer.num_known_blocks:  # the daemon no longer holds the parent
            if offer.earlier is None:  # the chain cannot reach this step's blocks
                self._count_dropped(f"the daemon no longer holds block {blocks.first_position} of group "
                                    f"{blocks.group_id}, the parent of this step's blocks", spec.request_id)
                return True
            self._release(session, daemon_request_id)
            blocks = offer.earlier.then(blocks)  # vLLM's own cache still has them: store from position 0
            acquired = self._acquire(session, daemon_request_id, blocks)
            num_hits = acquired.num_t0_hit_blocks + acquired.num_loading_blocks
        fresh_block_ids = acquired.block_ids[num_hits:blocks.num_blocks]
        if not fresh_block_ids:
            return True
        assert num_hits or blocks.first_position == 0 or offer.volatile, "a mid-chain commit needs its parent"
        self._copy_to_pool(self._groups[blocks.group_id], blocks.engine_block_ids[num_hits:], mapped_pool(session),
                           fresh_block_ids, event)
        if pages_read is not None:
            pages_read.set()
        block_size = len(blocks.token_ids) // blocks.num_blocks
        hashes, tokens = list(blocks.block_hashes[num_hits:]), list(blocks.token_ids[num_hits * block_size:])
        committed = self.retention.commit_and_release(session, spec.request_id, spec.retention, daemon_request_id,
                                                      blocks, num_hits, fresh_block_ids,
                                                      blocks.block_hashes[num_hits - 1] if num_hits else None)
        self._count_rpcs(1, hashes, tokens)
        self.stats.add("stored_blocks", len(fresh_block_ids))
        self.stats.add("stored_bytes", len(fresh_block_ids) * self._groups[blocks.group_id].block_nbytes)
        self.num_stored_blocks += len(fresh_block_ids)  # last: once it counts a store, `stats` has it
        return not committed.released

    def _acquire(self, session: Session, daemon_request_id: str, blocks: GroupBlocks):
        """Acquire `blocks` to store them (no hit, no query); counted in `stats`."""
        hashes, tokens = list(blocks.block_hashes), list(blocks.token_ids)
        acquired = session.acquire(daemon_request_id, hashes, 0, token_ids=tokens, for_store=True,
                                   recompute_s_per_token=self.prefill_cost.s_per_token)
        self._count_rpcs(1, hashes, tokens)
        return acquired

    def _release(self, session: Session, daemon_request_id: str) -> None:
        """Release a store's request (one its Commit did not release), counted in `stats`."""
        self._count_rpcs(1, (), ())
        release_after(self.link, session, daemon_request_id, None)

    def _count_rpcs(self, num_rpcs: int, block_hashes: Sequence[bytes], token_ids: Sequence[int]) -> None:
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

    def _copy_to_pool(self, group: ServedGroup, engine_block_ids: Sequence[int], pool: torch.Tensor,
                      pool_block_ids: Sequence[int], event: torch.cuda.Event | None) -> None:
        assert self.pages is not None, "store before register_kv_caches"
        if self._side_stream is None:
            self.pages.to_pool(group, engine_block_ids, pool, pool_block_ids)
            return
        with torch.cuda.stream(self._side_stream):
            if event is not None:
                self._side_stream.wait_event(event)
            self.pages.to_pool(group, engine_block_ids, pool, pool_block_ids)
        self._side_stream.synchronize()  # the bytes are in the pool before Commit shares them
