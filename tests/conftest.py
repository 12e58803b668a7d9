"""Shared fixtures and factories; the `gpu` marker skips without CUDA."""

from __future__ import annotations

import pytest
import torch

from kvtierd.layout import Layout


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA (torch.cuda.is_available() is false)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def small_layout(block_size: int = 4, **overrides) -> Layout:
    """A tiny layout: 2 layers, 2 KV heads of 8 dims, fp16."""
    fields = dict(model_id="test-model", num_layers=2, num_kv_heads=2, head_dim=8,
                  block_size=block_size, dtype="float16")
    fields.update(overrides)
    return Layout(**fields)
