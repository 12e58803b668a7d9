"""Adapters between inference runners and kvtierd, installed as `kvtierd.connectors`.

The reference paged-attention runner (a Llama decoder whose attention reads and writes the
daemon's pool through block tables) and the vLLM KVConnectorBase_V1 connector.
"""
