"""`KvtierdConnector`: kvtierd as a vLLM KV connector (KVConnectorBase_V1, vLLM 0.32), loaded out of tree.

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KvtierdConnector",
        "kv_connector_module_path": "kvtierd.connectors.vllm_connector", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"address": "unix:///run/kvtierd/kvtierd.sock"}}'

vLLM's KVConnectorFactory imports `kv_connector_module_path` and takes the attribute named
`kv_connector` (vllm/distributed/kv_transfer/kv_connector/factory.py, `get_connector_class`),
then builds it once per role, each in its own process: `cls(vllm_config, role,
kv_cache_config)` (a class without `kv_cache_config` is refused). This class is a thin
adapter: the scheduler role delegates to scheduler.SchedulerSide, the worker role to
worker.WorkerSide; method names and signatures are those of vLLM 0.32's
vllm/distributed/kv_transfer/kv_connector/v1/base.py.

vLLM is imported only here, and only if installed: without it `KVConnectorBase_V1` is a stand-in
and the class still imports (the unit tests drive it in vLLM's call order), defining the
metadata binding that the base class would otherwise provide.

It declares `SupportsHMA`, so vLLM keeps its hybrid memory allocator on (since vLLM PR #41847 a
connector without it turns the allocator off): sliding-window, Mamba / linear-attention and MLA
models keep their own KV cache groups, each stored and loaded as vLLM's own prefix cache would
serve it (kv_groups.py), and a model whose groups cannot be served is refused at start with one
line naming the kind. Tensor parallelism: each rank's KV is its own layout (tp_rank), a hit is
what every rank holds (the scheduler asks every rank's layout), and KV that vLLM reports
identical across ranks (`kv_tp_replicas`, MLA's latent cache) is one layout that the first rank
of each replica set writes and every rank loads.

kv_connector_extra_config keys (all optional, read once into a VllmExtraConfig): extra_config.py.
kv_role: `kv_both` loads and stores, `kv_consumer` only loads, `kv_producer` only stores.
`kv_load_failure_policy` must be "recompute" for a failed load (a block evicted or
corrupted after the lookup, the daemon gone) to be recomputed; vLLM's default "fail" fails the
request instead.

The layout: vLLM picks one `KVCacheLayout` for the engine (`kv_cache_config.kv_cache_layout`,
e.g. LBHNC on the CPU, LBNHC by default with FlashAttention); a block's bytes are its pages' bytes
as the engine holds them (engine_pages.py), so the layout name joins the model id in the key
namespace ("MODEL@vllm-LBHNC", and for several groups "MODEL@vllm-LBHNC/<groups>"): engines share
blocks with engines of the same model, dtype, geometry, groups and layout, never a misread one.

Keys are vLLM's own `Request.block_hashes`, computed whenever a KV connector is configured,
even with vLLM's prefix caching off (vllm/v1/engine/core.py). They chain from vLLM's
NONE_HASH (vllm/v1/core/kv_cache_utils.py, `init_none_hash`): with sha256 (the default
`--prefix-caching-hash-algo`) it is fixed unless PYTHONHASHSEED is set, so engines that share
a cache must agree on PYTHONHASHSEED (all unset, or all the same value); the xxhash algorithms
draw a random seed per process unless PYTHONHASHSEED is set. sha256* gives 32-byte keys
(daemon hash_algo "sha256"), xxhash* 16-byte ones ("xxh3_128").

This is a best-effort cache: `requires_kv_delivery` is False (a stored block is an offer, not
a hand-off another engine waits for), and `get_external_cache_hit_sources` names the tier
that served each hit (T0 device, T1 host, T2 disk).
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any, cast

import torch

from kvtierd.connectors.daemon_link import DaemonLink
from kvtierd.connectors.vllm.connector_stats import KvtierdConnectorStats, KvtierdPromMetrics
from kvtierd.connectors.vllm.daemon_lookup import daemon_lookup
from kvtierd.connectors.vllm.engine_layouts import RankLayouts
from kvtierd.connectors.vllm.engine_pages import EnginePages
from kvtierd.connectors.vllm.extra_config import VllmExtraConfig
from kvtierd.connectors.vllm.forward_timing import ForwardTimer
from kvtierd.connectors.vllm.kv_groups import engine_groups
from kvtierd.connectors.vllm.metadata import StepMetadata
from kvtierd.connectors.vllm.scheduler import SchedulerSide
from kvtierd.connectors.vllm.worker import WorkerSide
from kvtierd.layout import Layout

try:  # vLLM is optional: see the module docstring
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
        SupportsHMA,
    )
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
    VLLM_AVAILABLE = True
    KVConnectorMetadata.register(StepMetadata)
    HIT_SOURCES = (CacheHitSource.DEVICE, CacheHitSource.HOST, CacheHitSource.DISK)  # of T0, T1, T2 and T3
except ImportError:
    if not TYPE_CHECKING:  # pyright checks this package with vLLM installed (the vllm lane)
        class KVConnectorBase_V1:
            """Stands in for vLLM's base class where vLLM is not installed (the unit tests)."""

        class SupportsHMA:
            """vLLM's marker of a connector that serves its hybrid memory allocator (absent without vLLM)."""

    VLLM_AVAILABLE = False
    HIT_SOURCES = ("device", "host", "disk")

log = logging.getLogger(__name__)

LOADING_ROLES = {"kv_both", "kv_consumer"}
STORING_ROLES = {"kv_both", "kv_producer"}


def role_name(role: Any) -> str:
    """"scheduler" or "worker", from vLLM's KVConnectorRole or a string."""
    name = (getattr(role, "name", None) or str(role)).lower()
    if name not in ("scheduler", "worker"):
        raise ValueError(f"unknown connector role {role!r}")
    return name


def hash_algo_for(vllm_hash_algo: str) -> str:
    """The daemon's hash_algo whose digest size is that of vLLM's prefix_caching_hash_algo."""
    return "xxh3_128" if vllm_hash_algo.startswith("xxhash") else "sha256"


def configure_logging(environ=os.environ, vllm_logger: logging.Logger | None = None) -> None:
    """The connector's log lines go where vLLM's go, in every engine process that builds a
    connector. vLLM configures only its own "vllm" logger (a handler on stdout, its format), so
    the "kvtierd" loggers take that logger's handlers, at INFO (the attach line naming the daemon
    and its tiers, and every warning), or at KVTIERD_LOG_LEVEL where set: their lines appear in
    `vllm serve`'s log like vLLM's own. Where vLLM configured no handler (VLLM_CONFIGURE_LOGGING=0),
    KVTIERD_LOG_LEVEL gives them a stderr handler of their own; unset, Python's defaults apply
    (warnings to stderr). A level that is not one is refused and changes nothing."""
    level = environ.get("KVTIERD_LOG_LEVEL")
    if level and not isinstance(logging.getLevelName(level.upper()), int):
        raise ValueError(f"KVTIERD_LOG_LEVEL={level!r} is not a logging level (DEBUG, INFO, WARNING, ERROR)")
    package_log = logging.getLogger("kvtierd")
    if package_log.handlers:
        return
    vllm_handlers = list((vllm_logger or logging.getLogger("vllm")).handlers)
    if vllm_handlers:
        handlers, level = vllm_handlers, (level or "INFO")
    elif level:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s (pid %(process)d): %(message)s"))
        handlers = [handler]
    else:
        return
    package_log.setLevel(level.upper())
    for handler in handlers:
        package_log.addHandler(handler)
    package_log.propagate = False


def _tensor_parallel_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
        return get_tensor_model_parallel_rank()
    except (ImportError, AssertionError, AttributeError):
        return 0


class KvtierdConnector(KVConnectorBase_V1, SupportsHMA):
    """kvtierd behind vLLM's connector API. Exactly one of `scheduler` / `worker` is set, by role."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        configure_logging()
        if VLLM_AVAILABLE:
            super().__init__(vllm_config, role, kv_cache_config)
        self._connector_metadata = None
        self._num_reported_attach_failures = 0  # DaemonLink.num_attach_failures already in a stats report
        transfer_config = vllm_config.kv_transfer_config
        settings = VllmExtraConfig.from_extra(getattr(transfer_config, "kv_connector_extra_config", None))
        kv_role = getattr(transfer_config, "kv_role", None) or "kv_both"
        self.scheduler: SchedulerSide | None = None
        self.worker: WorkerSide | None = None
        self.role_name = role_name(role)
        is_worker = self.role_name == "worker"
        self._kv_cache_config = kv_cache_config
        self.engine_groups = engine_groups(kv_cache_config, prefix_caching=bool(
            getattr(vllm_config.cache_config, "enable_prefix_caching", False)))
        rank_layouts = RankLayouts(vllm_config, kv_cache_config, self.engine_groups, settings.model_id)
        rank = _tensor_parallel_rank() if is_worker else 0
        self.layout = rank_layouts.of_rank(rank)

        def link(layout: Layout) -> DaemonLink:
            return DaemonLink(layout, target=settings.address or os.environ.get("KVTIERD_ADDRESS"),
                              token=settings.token,
                              hash_algo=hash_algo_for(getattr(vllm_config.cache_config, "prefix_caching_hash_algo",
                                                              "sha256")),
                              map_pool=is_worker, timeout_s=settings.timeout_s, retry_after_s=settings.retry_after_s)

        if is_worker:
            self.worker = WorkerSide(link(self.layout), self.engine_groups, wait_timeout_s=settings.wait_timeout_s,
                                     writes=rank_layouts.writes(rank), start_attach_s=settings.start_attach_s,
                                     counts_tokens=rank == 0)
            self.forward_timer = ForwardTimer(self.worker.prefill_cost)  # brackets the forwards it measures
        else:
            assert settings.lookup_timeout_s is not None  # VllmExtraConfig resolves None
            self._scheduler_links = [link(layout) for layout in rank_layouts.layouts]
            self.scheduler = SchedulerSide(daemon_lookup(self._scheduler_links, self.engine_groups,
                                                         prefetch=settings.prefetch),
                                           self.engine_groups,
                                           loads=kv_role in LOADING_ROLES, stores=kv_role in STORING_ROLES,
                                           lookup_wait_s=settings.lookup_wait_s, lookup_ttl_s=settings.lookup_ttl_s,
                                           lookup_timeout_s=settings.lookup_timeout_s,
                                           async_loads=settings.async_loads)
            for scheduler_link in self._scheduler_links:  # before requests come (see WorkerSide.register)
                scheduler_link.session(deadline_s=settings.start_attach_s)
        log.info("kvtierd connector (%s, %s): layout %s, groups %s", self.role_name, kv_role, self.layout,
                 self.engine_groups.signature())

    @property
    def requires_kv_delivery(self) -> bool:
        """False: a best-effort cache; vLLM never waits for a store to be delivered."""
        return False

    # ------------------------------------------------------------------ metrics (connector_stats.py)

    def get_kv_connector_stats(self) -> KvtierdConnectorStats | None:
        """What this side did since the last call: the worker's loads and stores, the scheduler's lookups."""
        side = self.worker if self.worker is not None else self._scheduler()
        links = [self.worker.link] if self.worker is not None else self._scheduler_links
        num_attach_failures = sum(link.num_attach_failures for link in links)
        side.stats.add("attach_failures", num_attach_failures - self._num_reported_attach_failures)
        self._num_reported_attach_failures = num_attach_failures
        return side.stats.take()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KvtierdConnectorStats:
        return KvtierdConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: dict, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KvtierdPromMetrics:
        return KvtierdPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ------------------------------------------------------------------ metadata binding

    def bind_connector_metadata(self, connector_metadata: StepMetadata) -> None:
        # A KVConnectorMetadata by registration (KVConnectorMetadata.register above), which pyright cannot see.
        self._connector_metadata = cast("KVConnectorMetadata", connector_metadata)
        if self.worker is not None:  # the step's forward comes next
            self.forward_timer.step_started(connector_metadata)

    def clear_connector_metadata(self) -> None:
        self._connector_metadata = None

    def _step(self) -> StepMetadata:
        assert isinstance(self._connector_metadata, StepMetadata), self._connector_metadata
        return self._connector_metadata

    # ------------------------------------------------------------------ worker side

    def _worker(self) -> WorkerSide:
        if self.worker is None:
            raise RuntimeError("a worker-side method was called on the scheduler-side connector")
        return self.worker

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        pages = EnginePages(kv_caches, self.engine_groups, self._kv_cache_config)
        self.forward_timer.device = pages.device
        self._worker().register(pages)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._worker().start_load(self._step())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads complete in start_load_kv (ordered before the forward on the same stream)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # whole blocks, all layers, are stored from wait_for_save

    def wait_for_save(self) -> None:
        self.forward_timer.step_ended()  # the forward has run (CPU) or been launched (CUDA)
        self._worker().start_stores(self._step())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self._worker().get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker().take_load_error_block_ids()

    def handle_preemptions(self, kv_connector_metadata: StepMetadata) -> None:
        """Before this step touches a block (vLLM frees, zeroes and reuses them): preempted
        requests' stores have read their blocks, and so have the sliding-window and Mamba stores
        of earlier steps."""
        worker = self._worker()
        worker.wait_for_requests(set(kv_connector_metadata.preempted_req_ids))
        worker.wait_for_volatile_reads()

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
        if self.scheduler is not None:
            self.scheduler.shutdown()
            for link in self._scheduler_links:
                link.close()

    # ------------------------------------------------------------------ scheduler side

    def _scheduler(self) -> SchedulerSide:
        if self.scheduler is None:
            raise RuntimeError("a scheduler-side method was called on the worker-side connector")
        return self.scheduler

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._scheduler().update_state_after_alloc(request, blocks, num_external_tokens)

    def get_external_cache_hit_sources(self, request: Any, num_external_tokens: int) -> dict[Any, int]:
        """`num_external_tokens` split by the daemon tier that holds them: T0, then T1, then T2 and T3
        (storage, as vLLM's metrics see it)."""
        blocks = self._scheduler().external_hit_blocks(request.request_id, num_external_tokens)
        blocks_per_source = (blocks.t0, blocks.t1, blocks.t2 + blocks.t3)
        return {source: num_blocks * self.engine_groups.block_size
                for source, num_blocks in zip(HIT_SOURCES, blocks_per_source) if num_blocks}

    def build_connector_meta(self, scheduler_output: Any) -> StepMetadata:
        return self._scheduler().build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        return  # finished_sending is all the scheduler needs, and vLLM acts on it itself

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler().request_finished(request, block_ids)

    def request_finished_all_groups(self, request: Any,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's SupportsHMA hook: once per request, for every group at once; as request_finished."""
        return self._scheduler().request_finished(request, block_ids)
