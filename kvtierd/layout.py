"""The geometry of one KV block: which model, how many layers and heads, which dtype.

A layout fixes the bytes of a block, `num_layers × 2 × block_size × num_kv_heads × head_dim ×
dtype_bytes` (Llama-3-8B, fp16, 16 tokens: 32 × 2 × 16 × 8 × 128 × 2 = 2 MiB, 128 KiB a token),
and the block-major order of those bytes, `[num_layers, 2, block_size, num_kv_heads, head_dim]`.
Two layouts that differ in any field never share a cached block: the layout is part of every
key's root (see block_hash.py).
"""

from __future__ import annotations

import dataclasses
import struct
from typing import TYPE_CHECKING

from kvtierd.errors import InvalidArgument

if TYPE_CHECKING:
    import torch

# Name → bytes per element; each name is also torch's (`torch.<name>`). The names are part of
# the key encoding: never rename. No torch at import: the client and kvtierctl read layouts too.
# "uint8" is opaque bytes: an engine's pages that are not K and V of one float dtype (MLA latents,
# linear-attention state, hybrid groups), moved bit exact and never decoded (no fp8 codec).
DTYPES: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "uint8": 1}
FLOAT_DTYPES = frozenset(DTYPES) - {"uint8"}

# The order of a block's bytes; part of the key encoding, changed only with a new version.
BLOCK_MAJOR_ORDER = "layers,kv,tokens,heads,dim"


@dataclasses.dataclass(frozen=True, slots=True)
class Layout:
    """What a block holds. Immutable; validated on construction."""

    model_id: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int  # tokens per block
    dtype: str = "float16"
    tp_rank: int = 0
    tp_size: int = 1

    def __post_init__(self) -> None:
        if not self.model_id:
            raise InvalidArgument("layout.model_id must not be empty")
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size", "tp_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise InvalidArgument(f"layout.{name} must be a positive integer, got {value!r}")
        if not isinstance(self.tp_rank, int) or not 0 <= self.tp_rank < self.tp_size:
            raise InvalidArgument(
                f"layout.tp_rank must be in [0, tp_size={self.tp_size}), got {self.tp_rank!r}")
        if self.dtype not in DTYPES:
            raise InvalidArgument(
                f"layout.dtype {self.dtype!r} is not one of {', '.join(sorted(DTYPES))}")

    @property
    def dtype_bytes(self) -> int:
        return DTYPES[self.dtype]

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.dtype)

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token across all layers and KV heads."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """The shape of one block in the block-major order."""
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    def fingerprint(self) -> bytes:
        """A canonical, injective encoding of every field, for key roots and on-disk checks."""
        model = self.model_id.encode()
        dtype = self.dtype.encode()
        order = BLOCK_MAJOR_ORDER.encode()
        return b"".join((
            struct.pack("<I", len(model)), model,
            struct.pack("<7I", self.num_layers, self.num_kv_heads, self.head_dim,
                        self.block_size, self.tp_rank, self.tp_size, len(dtype)), dtype,
            struct.pack("<I", len(order)), order,
        ))


def llama3_8b(block_size: int = 16, dtype: str = "float16") -> Layout:
    """Llama-3-8B's KV geometry: 32 layers, 8 KV heads of 128 dims (GQA)."""
    return Layout("meta-llama/Meta-Llama-3-8B", 32, 8, 128, block_size, dtype)
