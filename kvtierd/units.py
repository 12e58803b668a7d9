"""Byte sizes and alignment, said once.

Sizes: an SI prefix is a power of 1000 and an IEC prefix a power of 1024, whatever the context
(daemon config, CLI flags, Helm values, `kvtierctl plan`): "40GB" = "40G" = 40·10⁹ bytes, as GPU
and disk vendors quote them; "40GiB" = "40Gi" = 40·2³⁰ bytes, as `free` and Kubernetes' "Gi"
do. The prefix letter's case does not matter ("512k" = "512K"); "B" alone, or no unit, is bytes;
a plain number may use scientific notation ("4e10"). A size is a whole number of bytes >= 0:
"1.5GiB" is fine, "0.5" is not.

Alignment: T1's host slots and T2's slots on disk start on ALIGNMENT_BYTES boundaries (the page
size, and what O_DIRECT needs), so a slot read from disk lands in a host slot without staging.
"""

from __future__ import annotations

import re
from fractions import Fraction

from kvtierd.errors import InvalidArgument

ALIGNMENT_BYTES = 4096
KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?(?:e\d+)?)\s*(?:([kmgt])(i)?b?|b)?\s*", re.IGNORECASE)
_PREFIXES = "kmgt"


def parse_bytes(text: object) -> int:
    """A byte count from an int or a string ("1048576", "40GB", "40GiB", "512Mi", "4e10");
    InvalidArgument for anything else (a TOML or flag value of any type may come here)."""
    if isinstance(text, bool) or not isinstance(text, (int, str)):
        raise InvalidArgument(f"expected a byte size, got {text!r}")
    if isinstance(text, int):
        if text < 0:
            raise InvalidArgument(f"a byte size must be >= 0, got {text}")
        return text
    match = _SIZE.fullmatch(text)
    if match is None:
        raise InvalidArgument(f"not a byte size: {text!r} (examples: 1048576, 40GB, 40GiB, 512MiB, 4e10)")
    number, prefix, binary = match.groups()
    scale = 1 if prefix is None else (1024 if binary else 1000) ** (_PREFIXES.index(prefix.lower()) + 1)
    exact = Fraction(number) * scale
    if exact.denominator != 1:
        raise InvalidArgument(f"{text!r} is not a whole number of bytes")
    return int(exact)


def ceil_div(numerator: int, denominator: int) -> int:
    """⌈numerator / denominator⌉ for integers, denominator > 0."""
    assert denominator > 0, denominator
    return -(-numerator // denominator)


def round_up(nbytes: int, alignment: int = ALIGNMENT_BYTES) -> int:
    """The smallest multiple of `alignment` >= `nbytes`."""
    return ceil_div(nbytes, alignment) * alignment
