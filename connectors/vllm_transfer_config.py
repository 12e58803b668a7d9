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
