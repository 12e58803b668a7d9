"""Weights of the reference Llama: from a random seed, or from safetensors files.

Tensors are keyed by transformers' LlamaForCausalLM parameter names
(`model.layers.3.self_attn.q_proj.weight`, ...), so a state dict moves between the two as is.
The safetensors reader is the format's documented layout (an 8-byte little-endian header
length, a JSON header of dtype / shape / data_offsets, then the raw bytes), read here with
the standard library and torch.frombuffer: no extra dependency.
"""

from __future__ import annotations

import json
import math
import mmap
import struct
from pathlib import Path

import torch

from kvtierd.connectors.reference.llama_config import LlamaConfig
from kvtierd.errors import InvalidArgument

SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
                      "I64": torch.int64, "I32": torch.int32, "U8": torch.uint8, "BOOL": torch.bool}
MAX_HEADER_BYTES = 100 << 20


def expected_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter of LlamaForCausalLM with its shape."""
    h, inner = config.hidden_size, config.intermediate_size
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, h),
                                          "model.norm.weight": (h,)}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (inner, h), p + "mlp.up_proj.weight": (inner, h),
            p + "mlp.down_proj.weight": (h, inner),
        })
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    return shapes


def random_weights(config: LlamaConfig, seed: int = 0, dtype: torch.dtype = torch.float32,
                   device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Weights drawn from `seed`: matrices N(0, 1/fan_in) so activations keep unit scale through
    the layers (and greedy decoding has clear winners), embeddings N(0, 1), norms near 1. Drawn
    on `device` by its own generator (a seed gives other weights on another device type)."""
    generator = torch.Generator(device=device).manual_seed(seed)
    weights = {}
    for name, shape in expected_shapes(config).items():
        tensor = torch.randn(shape, generator=generator, device=device)
        if len(shape) == 1:
            tensor = 1.0 + 0.1 * tensor
        elif name != "model.embed_tokens.weight":
            tensor /= math.sqrt(shape[1])
        weights[name] = tensor.to(dtype)
    return weights


def check_weights(config: LlamaConfig, weights: dict[str, torch.Tensor]) -> None:
    """InvalidArgument naming the first missing or misshapen parameter."""
    for name, shape in expected_shapes(config).items():
        if name not in weights:
            raise InvalidArgument(f"the weights have no {name}")
        if tuple(weights[name].shape) != shape:
            raise InvalidArgument(f"{name} has shape {tuple(weights[name].shape)}, the config says {shape}")


def read_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of one .safetensors file (copied out of the mapping, so the file may close)."""
    path = Path(path)
    with open(path, "rb") as file:
        size = path.stat().st_size
        if size < 8:
            raise InvalidArgument(f"{path} is not a safetensors file (only {size} bytes)")
        with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            header_bytes, = struct.unpack_from("<Q", mapped, 0)
            if header_bytes > min(MAX_HEADER_BYTES, size - 8):
                raise InvalidArgument(f"{path}: safetensors header of {header_bytes} bytes does not fit the file")
            try:
                header = json.loads(bytes(mapped[8:8 + header_bytes]))
            except ValueError as e:
                raise InvalidArgument(f"{path}: the safetensors header is not JSON: {e}") from e
            data_start = 8 + header_bytes
            tensors = {}
            for name, entry in header.items():
                if name == "__metadata__":
                    continue
                dtype = SAFETENSORS_DTYPES.get(entry.get("dtype"))
                if dtype is None:
                    raise InvalidArgument(f"{path}: tensor {name} has unsupported dtype {entry.get('dtype')!r}")
                begin, end = entry["data_offsets"]
                shape = tuple(entry["shape"])
                if not 0 <= begin <= end <= size - data_start or end - begin != math.prod(shape) * dtype.itemsize:
                    raise InvalidArgument(f"{path}: tensor {name} has data_offsets {begin}..{end} that do not "
                                          f"match its shape {shape} or the file")
                raw = bytearray(mapped[data_start + begin:data_start + end])
                tensors[name] = torch.frombuffer(raw, dtype=dtype).reshape(shape) if raw \
                    else torch.empty(shape, dtype=dtype)
    return tensors


def load_weights(path: str | Path, config: LlamaConfig, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Weights from a .safetensors file or a directory of them (a checkpoint), checked against `config`."""
    path = Path(path)
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    if not files:
        raise InvalidArgument(f"no .safetensors files in {path}")
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        weights.update(read_safetensors(file))
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    check_weights(config, weights)
    return {name: tensor.to(dtype) for name, tensor in weights.items() if name in expected_shapes(config)}
