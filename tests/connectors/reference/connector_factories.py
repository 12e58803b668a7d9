"""Small factories for the reference-runner tests: toy Llama configs, models and prompts."""

from __future__ import annotations

import torch

from kvtierd.connectors.reference.llama_config import LlamaConfig
from kvtierd.connectors.reference.llama_model import LlamaModel
from kvtierd.connectors.reference.llama_weights import random_weights

TOY = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2)


def toy_model(config: LlamaConfig = TOY, seed: int = 1) -> LlamaModel:
    return LlamaModel(config, random_weights(config, seed=seed))


def prompt(seed: int, length: int, vocab_size: int = TOY.vocab_size) -> list[int]:
    return torch.randint(0, vocab_size, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def empty_pool(config: LlamaConfig, num_blocks: int, block_size: int) -> torch.Tensor:
    layout = config.layout("toy", block_size)
    return torch.full((num_blocks, *layout.block_shape), float("nan"), dtype=layout.torch_dtype)
