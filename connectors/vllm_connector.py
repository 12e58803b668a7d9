"""The module that vLLM's `kv_connector_module_path` names: `kvtierd.connectors.vllm_connector`.

A stable path for engine configs; the connector itself is vllm/connector.py (`KvtierdConnector`).
"""

from kvtierd.connectors.vllm.connector import KvtierdConnector

__all__ = ["KvtierdConnector"]
