"""The reference runner: a paged-attention Llama decoder whose KV blocks can be kvtierd's."""
