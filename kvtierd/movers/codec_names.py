"""The names of the block codecs (block_codec.py has one class per name), without torch: the
config sections of the tiers that store blocks ([host], [ssd], [remote]) check their `codec` here."""

from __future__ import annotations

CODEC_NAMES = ("raw", "fp8")  # raw: the block's own bytes; fp8: e4m3 values and per-(block, layer, K/V) scales
