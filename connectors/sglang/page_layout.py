"""The daemon layout of an SGLang engine's pages: what one page of this rank's KV holds, and its name.

A layout is the namespace of its blocks (block_hash.py: the layout is part of every key's root), so
its fields say everything that makes two engines' pages the same bytes:

- MHA: `[layers, 2, page_size, kv_heads, head_dim]` of the model's KV dtype, this TP rank's heads
  (`tp_rank` / `tp_size`): K and V in the daemon's own block order (host_pages.py converts).
- MLA: the latents, replicated on every TP rank (one writer, rank 0 by SGLang's rule): an opaque uint8
  block of `layers × page_size × kv_dim` elements, TP 1 whatever the engine's TP.
- The name: `MODEL@sglang-mha` / `@sglang-mla`, and `/pp<rank>of<size>` under pipeline parallelism
  (each stage holds its own layers).
"""

from __future__ import annotations

import dataclasses

from kvtierd.layout import DTYPES, FLOAT_DTYPES, Layout


class UnsupportedEngine(ValueError):
    """An engine setup the connector refuses at start, said in one line."""


@dataclasses.dataclass(frozen=True)
class EngineShard:
    """Which part of the model's KV this process holds (from SGLang's HiCacheStorageConfig)."""

    model_name: str
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    is_mla: bool = False

    def model_id(self) -> str:
        name = f"{self.model_name}@sglang-{'mla' if self.is_mla else 'mha'}"
        return f"{name}/pp{self.pp_rank}of{self.pp_size}" if self.pp_size > 1 else name


def page_layout(shard: EngineShard, block_shape: tuple[int, ...], dtype: str) -> Layout:
    """The daemon layout of one page of `block_shape` (host_pages.HostPages.block_shape) in `dtype`
    (a torch dtype name, `torch.` removed)."""
    if not shard.model_name:
        raise UnsupportedEngine("SGLang passed no model name: set the engine's served model name")
    if shard.is_mla:
        num_layers, page_size, _, kv_dim = block_shape
        nbytes_per_token_layer = kv_dim * DTYPES.get(dtype, 0)
        if nbytes_per_token_layer == 0 or nbytes_per_token_layer % 2:
            raise UnsupportedEngine(f"an MLA page of dtype {dtype} and {kv_dim} dims is not supported")
        return Layout(shard.model_id(), num_layers, 1, nbytes_per_token_layer // 2, page_size, "uint8")
    num_layers, two, page_size, num_kv_heads, head_dim = block_shape
    assert two == 2, block_shape
    if dtype not in FLOAT_DTYPES:
        raise UnsupportedEngine(f"a KV cache of dtype {dtype} is not supported (use one of "
                                f"{', '.join(sorted(FLOAT_DTYPES))})")
    return Layout(shard.model_id(), num_layers, num_kv_heads, head_dim, page_size, dtype,
                  shard.tp_rank, shard.tp_size)
