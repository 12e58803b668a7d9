"""A Llama checkpoint in a GGUF file: its LlamaConfig and its weights, dequantized.

GGUF (llama.cpp's format) keeps the shape in `llama.*` metadata keys and the tensors under
llama.cpp's names (`blk.3.attn_q.weight`); the file is read with the `gguf` package (the
format's reference reader, from llama.cpp) and every quantized tensor dequantized by it to
float32. Two facts of llama.cpp's converter (convert_hf_to_gguf.py, `LlamaModel.permute`)
are undone here: the rows of attn_q and attn_k are permuted per head from HF's rotate-half
order into interleaved pairs, and a tied checkpoint has no `output.weight`.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvtierd.connectors.reference.llama_config import LlamaConfig
from kvtierd.connectors.reference.llama_weights import check_weights
from kvtierd.errors import InvalidArgument

if TYPE_CHECKING:  # the demo extra's GGUF reader, imported where a file is read
    from gguf import GGUFReader

_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
_LAYER_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj"}
_LAYER_TENSOR = re.compile(r"^blk\.(\d+)\.(\w+)\.weight$")


def open_gguf(path: str | Path):
    """A gguf.GGUFReader over `path`; InvalidArgument if it is not a GGUF file."""
    try:
        import gguf
    except ImportError as e:
        raise InvalidArgument("reading a GGUF model needs the gguf package: pip install 'kvtierd[demo]'") from e
    try:
        return gguf.GGUFReader(str(path))
    except (OSError, ValueError) as e:
        raise InvalidArgument(f"{path} is not a readable GGUF file: {e}") from e


def _field(reader: GGUFReader, key: str, default: Any = None) -> Any:
    """A metadata field's value (of whatever type the file gives it), or `default`."""
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def gguf_config(reader: GGUFReader) -> LlamaConfig:
    """The LlamaConfig of a GGUF file whose general.architecture is llama."""
    architecture = _field(reader, "general.architecture")
    if architecture != "llama":
        raise InvalidArgument(f"the reference runner implements Llama, the GGUF file holds {architecture!r}")
    if _field(reader, "llama.rope.scaling.type", "none") not in ("none", None):
        raise InvalidArgument("rope scaling is not implemented by the reference runner")
    names = {t.name for t in reader.tensors}
    embedding = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embedding is None:
        raise InvalidArgument("the GGUF file has no token_embd.weight")
    hidden, heads = int(_field(reader, "llama.embedding_length")), int(_field(reader, "llama.attention.head_count"))
    return LlamaConfig(
        vocab_size=int(embedding.shape[1]), hidden_size=hidden,
        intermediate_size=int(_field(reader, "llama.feed_forward_length")),
        num_hidden_layers=int(_field(reader, "llama.block_count")), num_attention_heads=heads,
        num_key_value_heads=int(_field(reader, "llama.attention.head_count_kv", heads)),
        head_dim=int(_field(reader, "llama.attention.key_length", hidden // heads)),
        rope_theta=float(_field(reader, "llama.rope.freq_base", 10000.0)),
        rms_norm_eps=float(_field(reader, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
        tie_word_embeddings="output.weight" not in names)


def hf_name(gguf_name: str) -> str | None:
    """transformers' parameter name for a GGUF tensor name (None: not a Llama parameter)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_TENSOR.match(gguf_name)
    if match and match.group(2) in _LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}.weight"
    return None


def unpermute_rotary_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head row permutation of attn_q / attn_k (interleaved pairs back to
    HF's rotate-half order): within a head, row 2i+j returns to j·(head_dim/2)+i."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def gguf_weights(reader, config: LlamaConfig, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Every parameter, dequantized, under transformers' LlamaForCausalLM names, checked against `config`."""
    from gguf.quants import dequantize

    weights = {}
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        if name is None:
            continue
        array = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        array = array.reshape(tuple(int(n) for n in reversed(tensor.shape)))  # GGUF lists the innermost first
        if name.endswith("q_proj.weight"):
            array = unpermute_rotary_rows(array, config.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            array = unpermute_rotary_rows(array, config.num_key_value_heads)
        weights[name] = torch.from_numpy(np.array(array, order="C")).to(dtype)  # a writable copy
    check_weights(config, weights)
    return weights


def load_gguf(path: str | Path, dtype: torch.dtype = torch.float32) -> tuple[LlamaConfig, dict[str, torch.Tensor]]:
    """The config and the dequantized weights of a Llama GGUF file."""
    reader = open_gguf(path)
    config = gguf_config(reader)
    return config, gguf_weights(reader, config, dtype)
