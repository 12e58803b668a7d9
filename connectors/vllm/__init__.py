"""kvtierd as a vLLM KV connector (KVConnectorBase_V1, vLLM 0.32): scheduler side, worker side, and what they share."""
