"""Stand-ins for the vLLM objects the kvtierd connector reads, and a CPU engine that drives the
connector's two roles in the order vLLM documents for one engine step. No tests here: the
test_vllm_* modules share it.

Attributes are those of the real objects: `Request` (vllm/v1/request.py: request_id,
prompt_token_ids, all_token_ids, num_tokens, num_computed_tokens, block_hashes,
kv_transfer_params), `KVCacheBlocks` (vllm/v1/core/kv_cache_manager.py: get_block_ids() → one
list per KV cache group), `SchedulerOutput` / `NewRequestData` / `CachedRequestData` (vllm/v1/core/sched/output.py),
`VllmConfig` pieces (vllm/config/: model_config.get_num_layers / get_num_kv_heads /
get_head_size, cache_config.block_size / cache_dtype / prefix_caching_hash_algo,
parallel_config, kv_transfer_config.kv_role / kv_connector_extra_config), `KVCacheConfig`'s
kv_cache_layout, and the per-layer KV cache views vLLM 0.32 registers (`vllm_kv_caches`, built
as vllm/v1/kv_cache_interface.py `create_kv_cache_views` builds them). The real-vLLM tests are
tests/connectors/vllm/test_vllm_engines.py.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import time

import torch

from kvtierd.connectors.vllm.connector import KvtierdConnector

NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 2, 2, 8, 4
MODEL = "vllm-connector-test"
BLOCK_SHAPE = (NUM_LAYERS, NUM_KV_HEADS, BLOCK_SIZE, 2 * HEAD_DIM)  # one engine block, every layer's page
# (at BLOCK_SIZE; the Engine and its Requests take another block size)


@dataclasses.dataclass
class ModelConfig:
    model: str = MODEL
    dtype: torch.dtype = torch.float16

    def get_num_layers(self, parallel_config) -> int:
        return NUM_LAYERS

    def get_num_kv_heads(self, parallel_config) -> int:
        return NUM_KV_HEADS

    def get_head_size(self) -> int:
        return HEAD_DIM


@dataclasses.dataclass
class CacheConfig:
    block_size: int = BLOCK_SIZE
    cache_dtype: str = "auto"
    prefix_caching_hash_algo: str = "sha256"


@dataclasses.dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1


@dataclasses.dataclass
class KVTransferConfig:
    kv_role: str = "kv_both"
    kv_connector: str = "KvtierdConnector"
    kv_connector_module_path: str = "kvtierd.connectors.vllm.connector"
    kv_connector_extra_config: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class VllmConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    parallel_config: ParallelConfig
    kv_transfer_config: KVTransferConfig


def vllm_config(address: str, kv_role: str = "kv_both", block_size: int = BLOCK_SIZE, **extra) -> VllmConfig:
    return VllmConfig(ModelConfig(), CacheConfig(block_size), ParallelConfig(),
                      KVTransferConfig(kv_role=kv_role, kv_connector_extra_config={"address": address, **extra}))


def chain_hashes(token_ids: list[int], block_size: int = BLOCK_SIZE) -> list[bytes]:
    """Full blocks only, each chained from its parent, as vLLM's request block hasher does."""
    parent, hashes = b"fake-none-hash", []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hashlib.sha256(parent + repr(token_ids[start:start + block_size]).encode()).digest()
        hashes.append(parent)
    return hashes


def prompt(seed: int, num_tokens: int, shared: list[int] = ()) -> list[int]:
    """`shared`, then token ids of `seed` alone: prompts of different seeds share only `shared`."""
    return list(shared) + [(seed * 7919 + i) % 30_000 + 10 for i in range(num_tokens - len(shared))]


class Request:
    def __init__(self, request_id: str, prompt_token_ids: list[int], block_size: int = BLOCK_SIZE,
                 kv_transfer_params: dict | None = None) -> None:
        self.request_id = request_id
        self.kv_transfer_params = kv_transfer_params  # SamplingParams.extra_args["kv_transfer_params"] in vLLM
        self.prompt_token_ids = list(prompt_token_ids)
        self.all_token_ids = list(prompt_token_ids)
        self.num_computed_tokens = 0
        # vLLM's Request holds a block hasher (attributes named as the real class's: the installed
        # vLLM's test checks that), not a block size
        self._block_hasher = functools.partial(chain_hashes, block_size=block_size)
        self.block_hashes = self._block_hasher(self.all_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def append_output(self, token_id: int) -> None:
        """A decoded token; a block it fills gets its hash, as vLLM's block hasher adds it."""
        self.all_token_ids.append(token_id)
        self.block_hashes = self._block_hasher(self.all_token_ids)


@dataclasses.dataclass
class KVCacheBlocks:
    block_ids: list[int]

    def get_block_ids(self) -> tuple[list[int], ...]:
        return (list(self.block_ids),)


@dataclasses.dataclass
class NewRequestData:
    req_id: str
    prompt_token_ids: list[int]
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int


@dataclasses.dataclass
class CachedRequestData:
    req_ids: list[str] = dataclasses.field(default_factory=list)
    resumed_req_ids: set[str] = dataclasses.field(default_factory=set)
    new_token_ids: list[list[int]] = dataclasses.field(default_factory=list)
    new_block_ids: list = dataclasses.field(default_factory=list)
    num_computed_tokens: list[int] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    finished_req_ids: set[str]
    preempted_req_ids: set[str] = dataclasses.field(default_factory=set)


# vLLM 0.32's KVCacheLayout (vllm/v1/kv_cache_layout.py): the physical order of the logical
# [layer, block, head, token, content] axes, outermost first.
KV_CACHE_LAYOUTS = {"LBHNC": (0, 1, 2, 3, 4), "LBNHC": (0, 1, 3, 2, 4), "LHBNC": (0, 2, 1, 3, 4),
                    "BLHNC": (1, 0, 2, 3, 4), "BLNHC": (1, 0, 3, 2, 4), "BHLNC": (1, 2, 0, 3, 4)}
KV_LAYOUTS = ["LBHNC", "LBNHC", "BLNHC"]  # CPU_ATTN's, FlashAttention's default, block-outermost


def vllm_kv_caches(layout_name: str, num_layers: int, num_blocks: int, num_kv_heads: int, block_size: int,
                   head_dim: int, dtype: torch.dtype, device: str = "cpu") -> dict[str, torch.Tensor]:
    """Layer name -> `[num_blocks, heads, block_size, 2 * head_dim]` views of one shared allocation,
    strided as `layout_name` places them (create_kv_cache_views: as_strided over one int8 tensor)."""
    logical = (num_layers, num_blocks, num_kv_heads, block_size, 2 * head_dim)
    strides, stride = [0] * 5, 1
    for axis in reversed(KV_CACHE_LAYOUTS[layout_name]):
        strides[axis] = stride
        stride *= logical[axis]
    raw = torch.zeros(math.prod(logical), dtype=dtype, device=device)
    full = raw.as_strided(logical, strides)
    return {f"model.layers.{layer}.self_attn.attn": full[layer] for layer in range(num_layers)}


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """vLLM's spec of an attention layer (vllm/v1/kv_cache_interface.py): the fields the connector reads.
    The connector tells the kinds apart by class name, as these fakes are named."""

    block_size: int = BLOCK_SIZE
    num_kv_heads: int = NUM_KV_HEADS
    head_size: int = HEAD_DIM
    dtype: torch.dtype = torch.float16

    @property
    def head_size_v(self) -> int:
        return self.head_size

    @property
    def page_size_bytes(self) -> int:
        return 2 * self.block_size * self.num_kv_heads * self.head_size * self.dtype.itemsize


@dataclasses.dataclass(frozen=True)
class FullAttentionSpec(AttentionSpec):
    pass


@dataclasses.dataclass(frozen=True)
class SlidingWindowSpec(AttentionSpec):
    sliding_window: int = 8


@dataclasses.dataclass(frozen=True)
class MambaSpec:
    """A linear-attention / SSM layer's state page, padded to `page_size_bytes`."""

    block_size: int = BLOCK_SIZE
    page_size_bytes: int = 256
    mamba_cache_mode: str = "align"
    num_speculative_blocks: int = 0
    num_prefill_checkpoint_blocks: int = 0


@dataclasses.dataclass
class KVCacheGroupSpec:
    layer_names: list[str]
    kv_cache_spec: object


@dataclasses.dataclass
class KVCacheTensor:
    size: int
    layers: list[str]
    layer_stride: int
    block_stride: int
    offset: int = 0


LAYER_NAMES = [f"model.layers.{layer}.self_attn.attn" for layer in range(NUM_LAYERS)]


@dataclasses.dataclass
class KVCacheConfig:
    """One full-attention group of every layer, as vLLM configures a uniform model (no KVCacheTensors:
    the connector then reads each layer's block stride from its view). `uniform` sets the block size."""

    kv_cache_layout: str = "LBHNC"
    kv_cache_groups: list = dataclasses.field(
        default_factory=lambda: [KVCacheGroupSpec(list(LAYER_NAMES), FullAttentionSpec())])
    kv_cache_tensors: list = dataclasses.field(default_factory=list)
    hash_block_size: int = BLOCK_SIZE
    kv_tp_replicas: int = 1
    num_blocks: int | None = None
    prefix_cacheable_group_ids: list | None = None  # None: every group

    @classmethod
    def uniform(cls, kv_cache_layout: str = "LBHNC", block_size: int = BLOCK_SIZE) -> KVCacheConfig:
        return cls(kv_cache_layout, [KVCacheGroupSpec(list(LAYER_NAMES), FullAttentionSpec(block_size))],
                   hash_block_size=block_size)


def block_value(block_hash: bytes, block_size: int = BLOCK_SIZE) -> torch.Tensor:
    """The KV a forward writes for a block: a fixed function of its hash."""
    generator = torch.Generator().manual_seed(int.from_bytes(block_hash[:8], "little") >> 1)
    shape = (NUM_LAYERS, NUM_KV_HEADS, block_size, 2 * HEAD_DIM)
    return torch.randn(shape, generator=generator).to(torch.float16)


def new_request_data(request: Request, block_ids: list[int], num_computed_tokens: int) -> NewRequestData:
    """`request` scheduled for the first time, `num_computed_tokens` of it already there (vLLM's own hits
    or a load); sets the request's count, as vLLM's scheduler has when it builds the metadata."""
    request.num_computed_tokens = num_computed_tokens
    return NewRequestData(request.request_id, request.prompt_token_ids, (block_ids,), num_computed_tokens)


def running_request_data(requests: list[Request], new_block_ids: list[list[int] | None] | None = None,
                         ) -> CachedRequestData:
    """`requests` scheduled again (a later chunk, a decode step), with the blocks allocated for this step."""
    new_ids = new_block_ids or [None] * len(requests)
    return CachedRequestData([r.request_id for r in requests], set(), [[] for _ in requests],
                             [None if ids is None else (ids,) for ids in new_ids],
                             [r.num_computed_tokens for r in requests])


@dataclasses.dataclass
class StepResult:
    num_external_tokens: int
    engine_block_ids: list[int]
    load_error_block_ids: set[int]
    metadata: object


class Engine:
    """vLLM's engine core and one worker on CPU: allocates engine blocks, calls the scheduler
    role, then the worker role, in the order of one engine step (see vllm_scheduler.py and
    vllm_worker.py), and writes `block_value` into the blocks a forward computes."""

    def __init__(self, address: str, kv_layout: str = "LBHNC", num_engine_blocks: int = 64,
                 device: str = "cpu", kv_role: str = "kv_both", block_size: int = BLOCK_SIZE, **extra) -> None:
        config = vllm_config(address, kv_role, block_size, **extra)
        self.block_size = block_size
        self.scheduler = KvtierdConnector(config, "scheduler", KVCacheConfig.uniform(kv_layout, block_size))
        self.worker = KvtierdConnector(config, "worker", KVCacheConfig.uniform(kv_layout, block_size))
        self.kv_caches = vllm_kv_caches(kv_layout, NUM_LAYERS, num_engine_blocks, NUM_KV_HEADS, block_size, HEAD_DIM,
                                        torch.float16, device)
        self.layer_caches = list(self.kv_caches.values())
        self.worker.register_kv_caches(dict(reversed(list(self.kv_caches.items()))))
        self.free_block_ids = list(range(num_engine_blocks))
        self.finished_waiting: dict[str, list[int]] = {}  # delayed frees: request id -> block ids
        self.finished_req_ids: set[str] = set()  # to tell the worker next step
        self.finished_sending: set[str] = set()
        self.finished_recving: set[str] = set()  # requests whose asynchronous loads were reported
        self.num_async_loads = 0

    # ---- engine block access, through vLLM's views (independent of the connector's own)
    def block(self, engine_block_id: int) -> torch.Tensor:
        return torch.stack([cache[engine_block_id] for cache in self.layer_caches]).cpu()

    def write_block(self, engine_block_id: int, value: torch.Tensor) -> None:
        for layer, cache in enumerate(self.layer_caches):
            cache[engine_block_id] = value[layer].to(cache.device)

    def zero_all_blocks(self) -> None:
        for cache in self.layer_caches:
            cache.zero_()

    # ---- the scheduler's side of a step
    def matched(self, request: Request, num_local_computed_tokens: int = 0,
                timeout_s: float = 15.0) -> tuple[int, bool]:
        """get_num_new_matched_tokens until it stops answering None: (tokens, load_async)."""
        deadline = time.monotonic() + timeout_s
        while True:
            num_tokens, load_async = self.scheduler.get_num_new_matched_tokens(request, num_local_computed_tokens)
            if num_tokens is not None:
                assert num_tokens or not load_async, "load_async with no tokens"
                return num_tokens, load_async
            assert time.monotonic() < deadline, "the lookup never finished"
            time.sleep(0.005)

    def matched_tokens(self, request: Request, num_local_computed_tokens: int = 0) -> int:
        return self.matched(request, num_local_computed_tokens)[0]

    def prefill(self, request: Request, timeout_s: float = 15.0) -> StepResult:
        """Engine steps that schedule `request` whole: lookup, allocate, build metadata, load
        (an asynchronous load: idle steps, as vLLM parks the request, until the worker reports it
        in finished_recving, then update_state_after_alloc with 0), forward (writes the blocks
        it computes), save, report."""
        num_external, load_async = self.matched(request)
        self.num_async_loads += load_async
        num_blocks = math.ceil(request.num_tokens / self.block_size)
        block_ids, self.free_block_ids = self.free_block_ids[:num_blocks], self.free_block_ids[num_blocks:]
        self.scheduler.update_state_after_alloc(request, KVCacheBlocks(block_ids), num_external)
        errors: set[int] = set()
        load_metadata = None
        if load_async:
            deadline = time.monotonic() + timeout_s
            load_metadata = self.idle_step(errors)
            while request.request_id not in self.finished_recving:
                assert time.monotonic() < deadline, "the asynchronous load was never reported"
                self.idle_step(errors)
                time.sleep(0.005)
            self.scheduler.update_state_after_alloc(request, KVCacheBlocks(block_ids), 0)
        new = new_request_data(request, block_ids, num_external)
        output = SchedulerOutput([new], CachedRequestData(), {request.request_id: request.num_tokens - num_external},
                                 self._take_finished())
        metadata, step_errors = self.compute_step(output, [(request, block_ids, range(
            num_external // self.block_size, len(request.block_hashes)))])
        errors |= step_errors
        if load_metadata is not None:  # the step that carried the load
            metadata = type(metadata)(load_metadata.loads, metadata.stores, metadata.preempted_req_ids)
        return StepResult(num_external, block_ids, errors, metadata)

    def compute_step(self, output: SchedulerOutput, computed: list[tuple[Request, list[int], range]]):
        """One engine step: the scheduler's metadata for `output`, then the worker's step, whose forward
        writes `block_value` into each request's blocks at the chain positions given; each scheduled
        request's num_computed_tokens advances after the metadata is built, as vLLM's scheduler does.
        Returns (the metadata, the step's load errors)."""
        metadata = self.scheduler.build_connector_meta(output)
        for request, _, _ in computed:
            request.num_computed_tokens = min(request.num_computed_tokens
                                              + output.num_scheduled_tokens[request.request_id], request.num_tokens)
        errors = self._worker_step(metadata, output, lambda: [
            self.write_block(block_ids[i], block_value(request.block_hashes[i], self.block_size))
            for request, block_ids, positions in computed for i in positions])
        return metadata, errors

    def idle_step(self, errors: set[int] | None = None):
        """A step with nothing scheduled; its load errors join `errors`. Returns its metadata."""
        output = SchedulerOutput([], CachedRequestData(), {}, self._take_finished())
        metadata = self.scheduler.build_connector_meta(output)
        step_errors = self._worker_step(metadata, output, lambda: None)
        if errors is not None:
            errors |= step_errors
        return metadata

    def _take_finished(self) -> set[str]:
        finished, self.finished_req_ids = self.finished_req_ids, set()
        return finished

    def _worker_step(self, metadata, output: SchedulerOutput, forward) -> set[int]:
        worker = self.worker
        worker.handle_preemptions(metadata)
        worker.bind_connector_metadata(metadata)
        worker.start_load_kv(None)
        forward()
        worker.wait_for_save()
        finished_sending, finished_recving = worker.get_finished(output.finished_req_ids)
        errors = worker.get_block_ids_with_load_errors()
        worker.clear_connector_metadata()
        self.finished_recving |= finished_recving or set()
        for request_id in finished_sending or ():
            assert request_id in self.finished_waiting, f"{request_id} reported but never delayed"
            self.free_block_ids += self.finished_waiting.pop(request_id)
            self.finished_sending.add(request_id)
        return errors

    def finish(self, request: Request, block_ids: list[int]) -> bool:
        """request_finished; frees now unless the connector delays. Returns the delay flag."""
        delay, params = self.scheduler.request_finished(request, block_ids)
        assert params is None
        if delay:
            self.finished_waiting[request.request_id] = block_ids
        else:
            self.free_block_ids += block_ids
        self.finished_req_ids.add(request.request_id)
        return delay

    def drain(self, timeout_s: float = 15.0) -> None:
        """Idle steps until every delayed request is reported by get_finished."""
        deadline = time.monotonic() + timeout_s
        while self.finished_waiting or self.finished_req_ids:
            assert time.monotonic() < deadline, f"never reported: {sorted(self.finished_waiting)}"
            self.idle_step()
            time.sleep(0.005)

    def close(self) -> None:
        self.worker.shutdown()
        self.scheduler.shutdown()


def prom_metrics(labelnames: list[str], per_engine_labelvalues: dict[int, list[str]]):
    """The connector's vLLM metrics built as vLLM builds them, into a registry of their own:
    (registry, metrics)."""
    from prometheus_client import CollectorRegistry, Counter, Histogram

    from kvtierd.connectors.vllm.connector import KvtierdConnector

    registry = CollectorRegistry()

    class RegistryCounter(Counter):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, registry=registry, **kwargs)

    class RegistryHistogram(Histogram):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, registry=registry, **kwargs)

    metrics = KvtierdConnector.build_prom_metrics(None, {Counter: RegistryCounter, Histogram: RegistryHistogram},
                                                  labelnames, per_engine_labelvalues)
    return registry, metrics
