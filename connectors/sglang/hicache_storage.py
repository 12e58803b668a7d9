"""kvtierd as SGLang's HiCache storage tier (L3): `KvtierdHiCacheStorage`, loaded by SGLang's dynamic
backend factory (sglang 0.5.23, mem_cache/storage/backend_factory.py):

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvtierd",
        "module_path": "kvtierd.connectors.sglang.hicache_storage",
        "class_name": "KvtierdHiCacheStorage", "interface_v1": 1}'

SGLang keeps its GPU cache (L1) and host pool (L2); the daemon is the node's L3, shared by every SGLang
process on the node and every node on its T3, surviving their restarts. Interface v1 only: SGLang
hands over host page indices and the backend copies the pages itself (page_store.py). The other keys
of the extra config (all optional): `address` (else KVTIERD_ADDRESS, else the default socket), `token`
(else KVTIERD_TOKEN: the tenant), `model_id` (the key namespace; default SGLang's model name),
`timeout_s` (5: per RPC), `retry_after_s` (5: between attach attempts), `map_pool` (true: pages are
copied through the daemon's pool mapped into SGLang's process; false: they travel in Put and Get, for a
daemon on another host).

Refused at start, in one line: no `interface_v1`, a hybrid model (SGLang registers Mamba, SWA or other
pools of its own through interface v2), context parallelism of attention or decode, and host layouts
page_host.py cannot address.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo

from kvtierd.connectors.daemon_link import DaemonLink
from kvtierd.connectors.sglang.host_pages import HostPages
from kvtierd.connectors.sglang.page_layout import EngineShard, UnsupportedEngine, page_layout
from kvtierd.connectors.sglang.page_store import DaemonPageStore

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 5.0
DEFAULT_RETRY_AFTER_S = 5.0


@dataclasses.dataclass(frozen=True, slots=True)
class StorageSettings:
    """The keys of SGLang's `--hicache-storage-backend-extra-config` this backend reads."""

    address: str | None = None
    token: str | None = None
    model_id: str | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S
    retry_after_s: float = DEFAULT_RETRY_AFTER_S
    map_pool: bool = True  # False: pages travel in Put and Get (a daemon on another host)

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any]) -> StorageSettings:
        if not extra.get("interface_v1"):
            raise UnsupportedEngine('kvtierd serves SGLang through storage interface v1: add "interface_v1": 1 '
                                    "to --hicache-storage-backend-extra-config")
        settings = cls(address=extra.get("address") or None, token=extra.get("token") or None,
                       model_id=extra.get("model_id") or None,
                       timeout_s=float(extra.get("timeout_s", DEFAULT_TIMEOUT_S)),
                       retry_after_s=float(extra.get("retry_after_s", DEFAULT_RETRY_AFTER_S)),
                       map_pool=bool(extra.get("map_pool", True)))
        if settings.timeout_s <= 0 or settings.retry_after_s < 0:
            raise UnsupportedEngine(f"timeout_s must be > 0 and retry_after_s >= 0, got {settings.timeout_s}, "
                                    f"{settings.retry_after_s}")
        return settings


def engine_shard(config: HiCacheStorageConfig, model_id: str | None) -> EngineShard:
    """This process's part of the model's KV; UnsupportedEngine for what the connector cannot key."""
    if config.attn_cp_size > 1 or config.dcp_size > 1:
        raise UnsupportedEngine("kvtierd's SGLang storage does not support context parallelism yet "
                                f"(attn_cp_size {config.attn_cp_size}, dcp_size {config.dcp_size})")
    if config.is_mla_model:  # the latents are the same on every TP rank: one layout for all of them
        return EngineShard(model_id or config.model_name or "", 0, 1, config.pp_rank, config.pp_size, True)
    return EngineShard(model_id or config.model_name or "", config.tp_rank, config.tp_size, config.pp_rank,
                       config.pp_size, False)


class KvtierdHiCacheStorage(HiCacheStorage):
    """SGLang's storage tier on a kvtierd daemon.

    Invariants: `store` is None until SGLang registers its host pool, then a DaemonPageStore over
    that pool's pages; every batch call answers misses (never raises) while the daemon cannot serve.
    """

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Mapping[str, Any] | None = None) -> None:
        self.settings = StorageSettings.from_extra(storage_config.extra_config or {})
        self.shard = engine_shard(storage_config, self.settings.model_id)
        self.store: DaemonPageStore | None = None

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        buffer = mem_pool_host.kv_buffer
        if not isinstance(buffer, torch.Tensor):
            raise UnsupportedEngine(f"{type(mem_pool_host).__name__} keeps no single KV buffer: this model's "
                                    "host pool is not supported by kvtierd's SGLang storage")
        pages = HostPages.of_buffer(buffer, "mla" if self.shard.is_mla else "mha", mem_pool_host.layout,
                                    mem_pool_host.page_size)
        layout = page_layout(self.shard, pages.block_shape, str(buffer.dtype).removeprefix("torch."))
        link = DaemonLink(layout, target=self.settings.address, token=self.settings.token,
                          map_pool=self.settings.map_pool,
                          timeout_s=self.settings.timeout_s, retry_after_s=self.settings.retry_after_s)
        self.store = DaemonPageStore(link, pages)
        log.info("kvtierd SGLang storage: layout %s (%d bytes a page, host layout %s)", layout.model_id,
                 layout.bytes_per_block, mem_pool_host.layout)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        if str(host_pool_name) != "kv":
            raise UnsupportedEngine(f"kvtierd's SGLang storage serves full-attention KV only; this model also has "
                                    f"a {host_pool_name} pool (hybrid models are not supported yet)")
        super().register_mem_host_pool_v2(host_pool, host_pool_name)

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        return self._store().count_leading(keys)

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        return self._store().load(keys, host_indices, _parent_key(extra_info))

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        return self._store().store(keys, host_indices, _parent_key(extra_info))

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # The generic (non-v1) path: SGLang uses it only without "interface_v1", which __init__ refuses.
    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        raise NotImplementedError("kvtierd's SGLang storage serves interface v1 (batch_get_v1)")

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> Any:
        raise NotImplementedError("kvtierd's SGLang storage serves interface v1 (batch_get_v1)")

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        raise NotImplementedError("kvtierd's SGLang storage serves interface v1 (batch_set_v1)")

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        raise NotImplementedError("kvtierd's SGLang storage serves interface v1 (batch_set_v1)")

    def clear(self) -> None:
        """SGLang's flush_cache: the daemon's blocks are the node's, shared with other engines and tenants,
        so nothing is dropped (`kvtierctl evict` drops a tenant's blocks)."""
        log.info("kvtierd SGLang storage: flush_cache leaves the daemon's blocks (kvtierctl evict drops them)")

    def close(self) -> None:
        if self.store is not None:
            self.store.link.close()

    def _store(self) -> DaemonPageStore:
        assert self.store is not None, "SGLang registers its host pool before any storage call"
        return self.store


def _parent_key(extra_info: HiCacheStorageExtraInfo | None) -> str | None:
    """The key before a batch's first page: the last of the earlier batches' keys, if any."""
    prefix_keys = extra_info.prefix_keys if extra_info is not None else None
    return prefix_keys[-1] if prefix_keys else None
