"""The worker side of the vLLM connector: bytes between the engine's KV pages and the pool, group by group.

Call order within one engine step on a worker (vllm/v1/worker/gpu_model_runner.py `execute_model`
and kv_connector_model_runner_mixin.py `_get_kv_connector_output`): `handle_preemptions(meta)`
(before anything of the step touches a block: vLLM zeroes and reuses freed blocks right after),
`bind_connector_metadata(meta)`, `start_load_kv(forward_context)`, the forward,
`wait_for_save()`, `get_finished(scheduler_output.finished_req_ids)`,
`get_block_ids_with_load_errors()`, `clear_connector_metadata()`.

Loads run in `start_load_kv` (worker_loads.py), stores start in `wait_for_save`, after the forward
wrote the step's KV (worker_stores.py). `get_finished` reports the requests whose asynchronous loads
have landed (`finished_recving`) and the finished requests whose store jobs are done
(`finished_sending`, worker_jobs.py). One thread runs the full-attention stores, the Retains and the
loads' Releases in order; the sliding-window and Mamba stores and the asynchronous loads each have a
thread of their own.
"""

from __future__ import annotations

import concurrent.futures

from kvtierd.connectors.daemon_link import DaemonLink
from kvtierd.connectors.prefill_cost import PrefillCost
from kvtierd.connectors.vllm.connector_stats import StatsRecorder
from kvtierd.connectors.vllm.engine_pages import EnginePagesLike
from kvtierd.connectors.vllm.group_hits import primary_group
from kvtierd.connectors.vllm.kv_groups import EngineGroups
from kvtierd.connectors.vllm.metadata import StepMetadata
from kvtierd.connectors.vllm.retention_calls import RetentionCalls
from kvtierd.connectors.vllm.worker_jobs import RequestJobs
from kvtierd.connectors.vllm.worker_loads import WorkerLoads
from kvtierd.connectors.vllm.worker_stores import WorkerStores

DEFAULT_START_ATTACH_S = 10.0  # the longest an engine's start waits for its first Attach


class WorkerSide:
    """The loads and stores of one worker, and what it reports to vLLM about them."""

    def __init__(self, link: DaemonLink, engine_groups: EngineGroups, *, wait_timeout_s: float = 30.0,
                 writes: bool = True, start_attach_s: float = DEFAULT_START_ATTACH_S,
                 counts_tokens: bool = True, prefill_cost: PrefillCost | None = None) -> None:
        assert start_attach_s > 0, start_attach_s  # the connector refuses a bad setting in one line
        self.link = link
        self.start_attach_s = start_attach_s
        self.engine_groups = engine_groups
        groups = {group.group_id: group for group in engine_groups.groups}
        self.pages: EnginePagesLike | None = None
        # The full-attention stores, the Retains and the loads' Releases, in that order.
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvtierd-store")
        self.jobs = RequestJobs()
        self.stats = StatsRecorder()  # for vLLM's connector metrics (connector_stats.py)
        self.retention = RetentionCalls(link, self.stats, engine_groups.block_size)  # hints (retention_calls.py)
        self.prefill_cost = prefill_cost or PrefillCost(engine_groups.block_size)  # reported on Acquires
        self.loads = WorkerLoads(link, groups, engine_groups.groups[primary_group(engine_groups.groups)].group_id,
                                 self.jobs, self.stats, self.prefill_cost, release_executor=self._executor,
                                 wait_timeout_s=wait_timeout_s, counts_tokens=counts_tokens)
        self.stores = WorkerStores(link, groups, self.jobs, self.stats, self.retention, self.prefill_cost,
                                   executor=self._executor, writes=writes)

    def register(self, pages: EnginePagesLike) -> None:
        """Take the engine's pages and attach, waiting at most `start_attach_s`: vLLM registers its
        KV caches before the engine serves, and the first forward that follows may hold the GIL for
        seconds (torch.compile of vLLM's CPU helpers), during which a gRPC call from another thread
        of this process barely progresses. A daemon that does not answer by then is attached later,
        by the first store that finds the retry due; a synchronous load never waits for an Attach
        (it fails over to recompute instead)."""
        self.pages = self.loads.pages = pages
        self.stores.register(pages)
        self.link.session(deadline_s=self.start_attach_s)

    def start_load(self, metadata: StepMetadata) -> None:
        self.loads.start(metadata)

    def take_load_error_block_ids(self) -> set[int]:
        return self.loads.take_load_error_block_ids()

    def start_stores(self, metadata: StepMetadata) -> None:
        self.stores.start(metadata)

    def wait_for_volatile_reads(self) -> None:
        self.stores.wait_for_volatile_reads()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(finished requests whose stores are all done, requests whose asynchronous loads are done)."""
        finished_loads = self.loads.take_finished()
        self.retention.forget(finished_req_ids)
        done = self.jobs.take_finished(finished_req_ids)
        return (done or None), (finished_loads or None)

    def wait_for_requests(self, request_ids: set[str]) -> None:
        """Block until the jobs of `request_ids` are done (their blocks are about to be reused)."""
        concurrent.futures.wait(self.jobs.futures_of(request_ids))

    def shutdown(self) -> None:
        self.loads.shutdown()
        self.stores.shutdown()
        self._executor.shutdown(wait=True)
        self.link.close()
