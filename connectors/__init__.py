"""Adapters between inference runners and kvtierd, imported as `kvtierd.connectors`.

The reference paged-attention runner (a Llama decoder whose attention reads and writes the
daemon's pool through block tables), the demo on it, and the vLLM KVConnectorBase_V1 connector.
`kvtierd/connectors` is a symlink to this folder, so a checkout imports it by the same path as
an install (the wheel holds the files themselves).
"""
