"""The shape of a Llama-architecture decoder, and the KV layout it gives the daemon.

Field names follow transformers' LlamaConfig (config.json) so that a checkpoint's config loads
as is; `from_hf` refuses what the reference runner does not implement (rope scaling, biases)
instead of computing something else.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from kvtierd.errors import InvalidArgument
from kvtierd.layout import Layout


@dataclasses.dataclass(frozen=True, slots=True)
class LlamaConfig:
    vocab_size: int = 32000
    hidden_size: int = 1024
    intermediate_size: int = 2816
    num_hidden_layers: int = 8
    num_attention_heads: int = 16
    num_key_value_heads: int = 8
    head_dim: int = 0  # 0: hidden_size // num_attention_heads
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise InvalidArgument(f"llama config: {name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise InvalidArgument(f"llama config: {self.num_attention_heads} attention heads are not a multiple "
                                  f"of {self.num_key_value_heads} KV heads")
        if self.head_dim == 0:
            if self.hidden_size % self.num_attention_heads:
                raise InvalidArgument("llama config: hidden_size is not a multiple of num_attention_heads; "
                                      "give head_dim")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if self.head_dim % 2:
            raise InvalidArgument(f"llama config: rotary embeddings need an even head_dim, got {self.head_dim}")

    @property
    def num_groups(self) -> int:
        """Query heads per KV head (grouped-query attention)."""
        return self.num_attention_heads // self.num_key_value_heads

    def layout(self, model_id: str, block_size: int = 16, dtype: str = "float32") -> Layout:
        """The daemon's layout for this model's KV cache."""
        return Layout(model_id, self.num_hidden_layers, self.num_key_value_heads, self.head_dim, block_size, dtype)

    def num_parameters(self) -> int:
        h, kv = self.hidden_size, self.num_key_value_heads * self.head_dim
        q = self.num_attention_heads * self.head_dim
        per_layer = h * q + 2 * h * kv + q * h + 3 * h * self.intermediate_size + 2 * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.vocab_size * h + self.num_hidden_layers * per_layer + h + head

    def to_hf(self) -> dict:
        """The config.json fields transformers' LlamaConfig takes."""
        fields = dataclasses.asdict(self)
        fields.update(model_type="llama", architectures=["LlamaForCausalLM"], attention_bias=False,
                      mlp_bias=False, hidden_act="silu", rope_scaling=None)
        return fields

    @classmethod
    def from_hf(cls, fields: dict) -> LlamaConfig:
        """From a transformers config.json dict; InvalidArgument for what this runner does not model."""
        if fields.get("model_type", "llama") not in ("llama", "mistral"):
            raise InvalidArgument(f"the reference runner implements Llama, not {fields.get('model_type')!r}")
        if fields.get("rope_scaling"):
            raise InvalidArgument(f"rope_scaling {fields['rope_scaling']!r} is not implemented by the reference runner")
        for flag in ("attention_bias", "mlp_bias"):
            if fields.get(flag):
                raise InvalidArgument(f"{flag} is not implemented by the reference runner")
        if fields.get("hidden_act", "silu") != "silu":
            raise InvalidArgument(f"hidden_act {fields['hidden_act']!r} is not silu")
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in fields.items() if k in names and v is not None}
        kwargs.setdefault("num_key_value_heads", fields.get("num_attention_heads", cls.num_attention_heads))
        return cls(**kwargs)

    @classmethod
    def from_file(cls, path: str | Path) -> LlamaConfig:
        try:
            fields = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            raise InvalidArgument(f"cannot read the model config {path}: {e}") from e
        return cls.from_hf(fields)
