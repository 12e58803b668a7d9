"""How a lower tier stores a block: the bytes of its slot, and the copies in and out of T0.

`raw` keeps the block's own bytes (the layout's dtype, block-major), bit exact: a job's blocks move
in one batched submission (span_copy.py), adjacent runs coalesced, whatever the ids.
`fp8` keeps e4m3 values with one float32 scale per (block, layer, K/V), half the bytes of fp16;
quantization runs on the pool's device before the copy down and dequantization after the copy
up, so only fp8 bytes cross PCIe. Both run inside a copy-engine job (on its stream or thread).
"""

from __future__ import annotations

import abc

import torch

from kvtierd.errors import InvalidArgument
from kvtierd.layout import FLOAT_DTYPES, Layout
from kvtierd.movers.codec_names import CODEC_NAMES
from kvtierd.movers.span_copy import copy_rows


class BlockCodec(abc.ABC):
    """Moves blocks between the pool `[num_blocks, *block_shape]` and uint8 slot rows."""

    name: str
    slot_nbytes: int

    def __init__(self, layout: Layout) -> None:
        self.layout = layout

    @abc.abstractmethod
    def encode(self, pool: torch.Tensor, block_ids: list[int], slots: torch.Tensor, slot_ids: list[int]) -> None:
        """Write pool blocks `block_ids` into slot rows `slot_ids`."""

    @abc.abstractmethod
    def decode(self, slots: torch.Tensor, slot_ids: list[int], pool: torch.Tensor, block_ids: list[int]) -> None:
        """Write slot rows `slot_ids` back into pool blocks `block_ids`."""


class RawCodec(BlockCodec):
    name = "raw"

    def __init__(self, layout: Layout) -> None:
        super().__init__(layout)
        self.slot_nbytes = layout.bytes_per_block

    def encode(self, pool: torch.Tensor, block_ids: list[int], slots: torch.Tensor, slot_ids: list[int]) -> None:
        copy_rows(slots, slot_ids, _byte_rows(pool), block_ids)

    def decode(self, slots: torch.Tensor, slot_ids: list[int], pool: torch.Tensor, block_ids: list[int]) -> None:
        copy_rows(_byte_rows(pool), block_ids, slots, slot_ids)


def _byte_rows(pool: torch.Tensor) -> torch.Tensor:
    """The contiguous pool `[num_blocks, *block_shape]` as uint8 rows `[num_blocks, bytes_per_block]` (a view)."""
    assert pool.is_contiguous()
    return pool.view(torch.uint8).view(pool.shape[0], -1)


class Fp8Codec(BlockCodec):
    name = "fp8"

    def __init__(self, layout: Layout) -> None:
        super().__init__(layout)
        from kvtierd.movers.fp8_codec import fp8_slot_nbytes

        if layout.dtype == "float8_e4m3fn":
            raise InvalidArgument("the fp8 codec needs a wider pool dtype; this pool already stores fp8")
        if layout.dtype not in FLOAT_DTYPES:
            raise InvalidArgument(f"the fp8 codec quantizes K and V values; layout {layout.model_id!r} holds "
                                  f"opaque {layout.dtype} pages (use the raw codec for it)")
        self.slot_nbytes = fp8_slot_nbytes(layout)

    def encode(self, pool: torch.Tensor, block_ids: list[int], slots: torch.Tensor, slot_ids: list[int]) -> None:
        from kvtierd.movers.fp8_codec import pack_fp8_slot, quantize_fp8

        index = torch.tensor(block_ids, dtype=torch.long, device=pool.device)
        packed = pack_fp8_slot(*quantize_fp8(pool.index_select(0, index)))
        copy_rows(slots, slot_ids, packed, range(len(slot_ids)))

    def decode(self, slots: torch.Tensor, slot_ids: list[int], pool: torch.Tensor, block_ids: list[int]) -> None:
        from kvtierd.movers.fp8_codec import dequantize_fp8, unpack_fp8_slot

        staged = torch.empty((len(slot_ids), self.slot_nbytes), dtype=torch.uint8, device=pool.device)
        copy_rows(staged, range(len(slot_ids)), slots, slot_ids)
        payload, scales = unpack_fp8_slot(staged, self.layout)
        index = torch.tensor(block_ids, dtype=torch.long, device=pool.device)
        pool.index_copy_(0, index, dequantize_fp8(payload, scales, self.layout.torch_dtype))


CODECS = {"raw": RawCodec, "fp8": Fp8Codec}
assert tuple(CODECS) == CODEC_NAMES, "one codec class per name of codec_names.py"


def make_codec(name: str, layout: Layout) -> BlockCodec:
    if name not in CODECS:
        raise InvalidArgument(f"tier codec {name!r} is not one of {', '.join(CODECS)}")
    return CODECS[name](layout)
