"""The connector's logic on the installed vLLM's own objects: its base class, config, Request and
block hasher, KVCacheBlocks, SchedulerOutput, KV cache allocation and stats classes.

Runs in the vLLM venv (`.venv-vllm/bin/python -m pytest tests/connectors/vllm/on_vllm`; the main
suite does that in tests/connectors/vllm/test_on_installed_vllm.py). Also checks that
tests/connectors/vllm/vllm_fakes.py, which the main suite's fast connector tests use, names only
fields these classes have and builds the KV cache views vLLM builds, so that the fakes cannot drift
from the installed vLLM unnoticed.
"""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch
from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
    supports_hma,
)
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock, get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MambaSpec,
    SlidingWindowSpec,
    compute_layout_strides,
)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.metrics.cache_hit_source import CacheHitSource
from vllm.v1.metrics.stats import PrefixCacheStats
from vllm.v1.request import Request
from vllm.v1.worker.utils import allocate_kv_cache

from kvtierd.connectors.vllm.connector import KvtierdConnector
from kvtierd.connectors.vllm.engine_pages import EnginePages
from kvtierd.connectors.vllm.kv_groups import engine_groups
from kvtierd.connectors.vllm.metadata import StepMetadata
from kvtierd.launch.daemon_process import DaemonProcess, small_daemon_args, wait_until
from tests.connectors.vllm import vllm_fakes

NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_ENGINE_BLOCKS = 4, 2, 64, 32, 24
LAYER_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS)]
SPEC = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_DIM, dtype=torch.float32)


def kv_cache_config(layout: KVCacheLayout) -> KVCacheConfig:
    """One KVCacheTensor for all layers, strided as vLLM's get_kv_cache_config_from_groups does."""
    layer_stride, block_stride, *_ = compute_layout_strides(SPEC, NUM_ENGINE_BLOCKS, NUM_LAYERS, layout,
                                                            fixed_strides=(None,) * 5)
    tensor = KVCacheTensor(size=NUM_LAYERS * NUM_ENGINE_BLOCKS * SPEC.page_size_bytes, layers=LAYER_NAMES,
                           layer_stride=layer_stride, block_stride=block_stride)
    return KVCacheConfig(num_blocks=NUM_ENGINE_BLOCKS, kv_cache_tensors=[tensor],
                         kv_cache_groups=[KVCacheGroupSpec(LAYER_NAMES, SPEC)], kv_cache_layout=layout.name)


def engine_kv_caches(layout: KVCacheLayout) -> dict[str, torch.Tensor]:
    """The per-layer views vLLM's worker hands to register_kv_caches (vllm/v1/worker/utils.py)."""
    return allocate_kv_cache(kv_cache_config(layout), torch.device("cpu"), layout)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    import transformers

    directory = tmp_path_factory.mktemp("tiny-llama-config")
    transformers.LlamaConfig(vocab_size=1000, hidden_size=NUM_KV_HEADS * 2 * HEAD_DIM, intermediate_size=512,
                             num_hidden_layers=NUM_LAYERS, num_attention_heads=2 * NUM_KV_HEADS,
                             num_key_value_heads=NUM_KV_HEADS, head_dim=HEAD_DIM,
                             max_position_embeddings=1024).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    with DaemonProcess(small_daemon_args(str(tmp_path_factory.mktemp("kvtierd")), t0_bytes="32MiB")) as process:
        yield process


def real_vllm_config(model_dir, address: str) -> VllmConfig:
    transfer = KVTransferConfig(kv_connector="KvtierdConnector",
                                kv_connector_module_path="kvtierd.connectors.vllm.connector", kv_role="kv_both",
                                kv_load_failure_policy="recompute",
                                kv_connector_extra_config={"address": address, "lookup_wait_s": 2.0})
    return VllmConfig(model_config=ModelConfig(model=str(model_dir), skip_tokenizer_init=True, dtype="float32",
                                               max_model_len=512, enforce_eager=True),
                      cache_config=CacheConfig(block_size=BLOCK_SIZE), kv_transfer_config=transfer)


def real_request(request_id: str, token_ids: list[int], block_size: int = BLOCK_SIZE) -> Request:
    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    return Request(request_id, token_ids, SamplingParams(max_tokens=4), None,
                   block_hasher=get_request_block_hasher(block_size, hash_fn))


def blocks(block_ids: list[int]) -> KVCacheBlocks:
    return KVCacheBlocks((tuple(KVCacheBlock(block_id) for block_id in block_ids),))


def scheduled_new(request: Request, block_ids: list[int], num_computed_tokens: int) -> SchedulerOutput:
    """A step that schedules `request` for the rest of its prompt."""
    new = NewRequestData(req_id=request.request_id, prompt_token_ids=request.prompt_token_ids, mm_features=[],
                         sampling_params=request.sampling_params, pooling_params=None, block_ids=(block_ids,),
                         num_computed_tokens=num_computed_tokens, lora_request=None)
    num_tokens = request.num_tokens - num_computed_tokens
    return SchedulerOutput(scheduled_new_reqs=[new], scheduled_cached_reqs=CachedRequestData.make_empty(),
                           num_scheduled_tokens={request.request_id: num_tokens}, total_num_scheduled_tokens=num_tokens,
                           scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={}, finished_req_ids=set(),
                           free_encoder_mm_hashes=[])


# ---------------------------------------------------------------------------- the API's shape

def test_every_hook_takes_the_parameters_of_vllms_base_class():
    """An override whose parameter names differ from KVConnectorBase_V1's would break a keyword call."""
    overridden = [name for name, value in vars(KvtierdConnector).items()
                  if callable(value) and not name.startswith("_") and hasattr(KVConnectorBase_V1, name)]
    assert {"get_num_new_matched_tokens", "handle_preemptions", "get_external_cache_hit_sources",
            "start_load_kv", "get_finished"} <= set(overridden)
    for name in overridden:
        ours = list(inspect.signature(getattr(KvtierdConnector, name)).parameters)
        theirs = list(inspect.signature(getattr(KVConnectorBase_V1, name)).parameters)
        assert ours == theirs, (name, ours, theirs)
    assert not getattr(KvtierdConnector, "__abstractmethods__", ()), KvtierdConnector.__abstractmethods__
    assert isinstance(StepMetadata(), KVConnectorMetadata)
    assert supports_hma(KvtierdConnector)  # vLLM keeps its hybrid allocator on for this connector
    ours = list(inspect.signature(KvtierdConnector.request_finished_all_groups).parameters)
    assert ours == list(inspect.signature(SupportsHMA.request_finished_all_groups).parameters)


def test_the_fakes_name_only_fields_the_real_classes_have(model_dir):
    """tests/connectors/vllm/vllm_fakes.py stands in for these classes in the main suite; every attribute it gives
    them must exist on the installed vLLM's."""
    token_ids = list(range(3, 3 + 3 * vllm_fakes.BLOCK_SIZE + 1))
    request = real_request("r", token_ids, vllm_fakes.BLOCK_SIZE)
    fake_request = vllm_fakes.Request("r", token_ids)
    assert set(vars(fake_request)) <= set(dir(request)), set(vars(fake_request)) - set(dir(request))
    assert len(request.block_hashes) == len(fake_request.block_hashes) == 3  # full blocks only
    assert all(len(h) == len(f) == 32 for h, f in zip(request.block_hashes, fake_request.block_hashes))
    assert fake_request.num_tokens == request.num_tokens
    pairs = [(vllm_fakes.NewRequestData, NewRequestData), (vllm_fakes.CachedRequestData, CachedRequestData),
             (vllm_fakes.SchedulerOutput, SchedulerOutput)]
    for fake, real in pairs:
        real_fields = {field.name for field in dataclasses.fields(real)}
        fake_fields = {field.name for field in dataclasses.fields(fake)}
        assert fake_fields <= real_fields, (fake.__name__, fake_fields - real_fields)
    assert blocks([4, 5]).get_block_ids() == vllm_fakes.KVCacheBlocks([4, 5]).get_block_ids()
    for fake, real in [(vllm_fakes.FullAttentionSpec, FullAttentionSpec),
                       (vllm_fakes.SlidingWindowSpec, SlidingWindowSpec),
                       (vllm_fakes.MambaSpec, MambaSpec), (vllm_fakes.KVCacheGroupSpec, KVCacheGroupSpec),
                       (vllm_fakes.KVCacheTensor, KVCacheTensor), (vllm_fakes.KVCacheConfig, KVCacheConfig)]:
        real_names = set(dir(real)) | {field.name for field in dataclasses.fields(real)}
        fake_names = {field.name for field in dataclasses.fields(fake)}
        assert fake_names <= real_names, (fake.__name__, fake_names - real_names)
        assert fake.__name__ == real.__name__  # the connector tells kinds apart by class name
    spec = vllm_fakes.FullAttentionSpec(BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, torch.float32)
    assert spec.page_size_bytes == FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=NUM_KV_HEADS,
                                                     head_size=HEAD_DIM, dtype=torch.float32).page_size_bytes


@pytest.mark.parametrize("layout", list(KVCacheLayout), ids=lambda layout: layout.name)
def test_the_fakes_build_the_kv_cache_views_vllm_allocates(layout):
    """Shape, strides and each layer's offset in the shared allocation, for every KVCacheLayout."""
    real = engine_kv_caches(layout)
    fake = vllm_fakes.vllm_kv_caches(layout.name, NUM_LAYERS, NUM_ENGINE_BLOCKS, NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM,
                                     torch.float32)
    assert list(real) == list(fake) == LAYER_NAMES
    for name in LAYER_NAMES:
        assert real[name].shape == fake[name].shape and real[name].dtype == fake[name].dtype
        assert real[name].stride() == fake[name].stride(), (name, real[name].stride(), fake[name].stride())
        assert real[name].storage_offset() == fake[name].storage_offset(), name


@pytest.mark.parametrize("layout", list(KVCacheLayout), ids=lambda layout: layout.name)
def test_engine_pages_move_vllms_own_views_bit_for_bit(model_dir, layout):
    """Blocks 3, 7, 8 of vLLM's allocation to pool slots 5, 0, 1 and back into blocks 10, 11, 2."""
    caches = engine_kv_caches(layout)
    for index, cache in enumerate(caches.values()):
        cache.copy_(torch.randn(cache.shape, generator=torch.Generator().manual_seed(index)))
    config = kv_cache_config(layout)
    connector = KvtierdConnector(real_vllm_config(model_dir, "unix:///nonexistent.sock"), KVConnectorRole.WORKER,
                                 config)
    groups = engine_groups(config, prefix_caching=False)
    assert groups.uniform_attention
    engine = EnginePages(caches, groups, config)
    pool = torch.zeros(6, NUM_LAYERS, 2 * BLOCK_SIZE * NUM_KV_HEADS * HEAD_DIM)
    engine.to_pool(groups.groups[0], [3, 7, 8], pool, [5, 0, 1])
    engine.from_pool(groups.groups[0], pool, [5, 0, 1], [10, 11, 2])
    for cache in caches.values():
        for source, target in ((3, 10), (7, 11), (8, 2)):
            assert torch.equal(cache[source], cache[target])
    assert connector.layout.model_id.endswith(f"@vllm-{layout.name}")
    connector.shutdown()


# ---------------------------------------------------------------------------- both roles, one daemon

def test_a_request_stored_through_the_worker_is_a_device_hit_for_the_next_one_and_loads_its_bytes(
        model_dir, daemon):
    """Real config, Request, KVCacheBlocks and SchedulerOutput through both roles against a real daemon:
    A's 3 full blocks are stored; B (A's first 3 blocks, then its own) is matched 96 tokens, vLLM's
    stats take the hit as "device" (T0), and the load writes A's bytes into B's blocks."""
    layout = KVCacheLayout.LBHNC
    config = real_vllm_config(model_dir, daemon.address)
    scheduler = KvtierdConnector(config, KVConnectorRole.SCHEDULER, kv_cache_config(layout))
    worker = KvtierdConnector(config, KVConnectorRole.WORKER, kv_cache_config(layout))
    caches = engine_kv_caches(layout)
    worker.register_kv_caches(caches)
    for index, cache in enumerate(caches.values()):
        cache.copy_(torch.randn(cache.shape, generator=torch.Generator().manual_seed(100 + index)))

    def run_step(scheduler_output: SchedulerOutput, finished: set[str] = frozenset()):
        metadata = scheduler.build_connector_meta(scheduler_output)
        worker.handle_preemptions(metadata)
        worker.bind_connector_metadata(metadata)
        worker.start_load_kv(None)
        worker.wait_for_save()
        done = worker.get_finished(set(finished))
        errors = worker.get_block_ids_with_load_errors()
        worker.clear_connector_metadata()
        return metadata, done, errors

    a = real_request("a", [5 + (7 * i) % 900 for i in range(3 * BLOCK_SIZE + 10)])
    assert scheduler.get_num_new_matched_tokens(a, 0) == (0, False)
    a_blocks = [3, 4, 5, 6]
    scheduler.update_state_after_alloc(a, blocks(a_blocks), 0)
    metadata, _, errors = run_step(scheduled_new(a, a_blocks, 0))
    assert [spec.groups[0].blocks.num_blocks for spec in metadata.stores] == [3] and not errors
    a.num_computed_tokens = a.num_tokens
    assert scheduler.request_finished(a, a_blocks) == (True, None)  # vLLM keeps them until the store is done
    empty = SchedulerOutput.make_empty()
    assert wait_until(lambda: "a" in (run_step(empty, {"a"})[1][0] or ()), timeout_s=30)

    b = real_request("b", a.prompt_token_ids[:3 * BLOCK_SIZE] + [11, 12, 13, 14])
    assert b.block_hashes[:3] == a.block_hashes[:3]
    assert scheduler.get_num_new_matched_tokens(b, 0) == (3 * BLOCK_SIZE, False)  # all in T0: a sync load
    sources = scheduler.get_external_cache_hit_sources(b, 3 * BLOCK_SIZE)
    assert sources == {CacheHitSource.DEVICE: 3 * BLOCK_SIZE}
    stats = PrefixCacheStats()
    stats.record(num_tokens=b.num_tokens, num_hits=3 * BLOCK_SIZE, preempted=False, hits_by_source=sources)
    assert stats.hits == 3 * BLOCK_SIZE
    b_blocks = [12, 13, 14, 15]
    scheduler.update_state_after_alloc(b, blocks(b_blocks), 3 * BLOCK_SIZE)
    metadata, _, errors = run_step(scheduled_new(b, b_blocks, 3 * BLOCK_SIZE))
    assert [(spec.request_id, spec.engine_block_ids) for spec in metadata.loads] == [("b", (12, 13, 14))]
    assert not errors
    for cache in caches.values():
        for source, target in zip(a_blocks[:3], b_blocks[:3]):
            assert torch.equal(cache[source], cache[target])
    scheduler.shutdown()
    worker.shutdown()


def test_a_down_daemon_answers_no_hit_and_every_hook_returns(model_dir, tmp_path):
    """Nobody at the address: 0 matched tokens, no sources, a step with nothing to move."""
    config = real_vllm_config(model_dir, f"unix://{tmp_path}/nobody.sock")
    scheduler = KvtierdConnector(config, KVConnectorRole.SCHEDULER, kv_cache_config(KVCacheLayout.LBHNC))
    request = real_request("c", list(range(10, 10 + 2 * BLOCK_SIZE + 1)))
    assert scheduler.get_num_new_matched_tokens(request, 0) == (0, False)
    assert scheduler.get_external_cache_hit_sources(request, 0) == {}
    metadata = scheduler.build_connector_meta(SchedulerOutput.make_empty())
    assert metadata.loads == [] and metadata.stores == []
    scheduler.shutdown()
