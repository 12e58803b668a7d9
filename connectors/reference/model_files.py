"""A model for the reference runner from files: a GGUF file, or a Hugging Face directory.

A GGUF file (llama.cpp's format) holds the config, the weights (dequantized here) and the
tokenizer with its chat template. A Hugging Face directory holds config.json, *.safetensors
and, for chat, the tokenizer files. `save_hf_directory` writes the second from the first, so a
GGUF model (dequantized) serves through engines that read Hugging Face directories (vLLM).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from kvtierd.connectors.reference.chat_tokenizer import ChatTokenizer
from kvtierd.connectors.reference.gguf_weights import load_gguf
from kvtierd.connectors.reference.llama_config import LlamaConfig
from kvtierd.connectors.reference.llama_weights import load_weights
from kvtierd.errors import InvalidArgument


@dataclasses.dataclass(frozen=True, slots=True)
class ModelFiles:
    name: str  # the file or directory name, for reports
    config: LlamaConfig
    weights: dict[str, torch.Tensor]
    tokenizer: ChatTokenizer


def load_model_files(path: str | Path, dtype: torch.dtype = torch.float32) -> ModelFiles:
    path = Path(path).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        config, weights = load_gguf(path, dtype)
        return ModelFiles(path.name.removesuffix(".gguf"), config, weights, ChatTokenizer.from_gguf(path))
    if path.is_dir():
        config_path = path / "config.json"
        if not config_path.is_file():
            raise InvalidArgument(f"{path} has no config.json (a model is a GGUF file or a Hugging Face directory)")
        config = LlamaConfig.from_file(config_path)
        return ModelFiles(path.name, config, load_weights(path, config, dtype), ChatTokenizer.from_directory(path))
    raise InvalidArgument(f"{path} is neither a .gguf file nor a model directory")


def save_hf_directory(files: ModelFiles, directory: str | Path, dtype: torch.dtype = torch.float32) -> Path:
    """config.json (a LlamaConfig without quantization), model.safetensors and the tokenizer
    files of `files` in `directory`; returns it. transformers refuses `save_pretrained` on a
    GGUF-loaded model, so the pieces are written here."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = files.config.to_hf()
    config.update(torch_dtype=str(dtype).removeprefix("torch."), bos_token_id=1,
                  eos_token_id=files.tokenizer.eos_token_id, max_position_embeddings=8192)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    save_file({name: tensor.to(dtype).contiguous() for name, tensor in files.weights.items()},
              str(directory / "model.safetensors"), metadata={"format": "pt"})
    files.tokenizer.save(directory)
    return directory
