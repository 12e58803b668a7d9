"""Words in the CLIs' human output: a count and its noun agree ("1 block", "2 blocks")."""

from __future__ import annotations


def plural(count: int, noun: str, plural_noun: str | None = None) -> str:
    """`1 block`, `0 blocks`, `1,024 blocks`; `plural(n, "miss", "misses")` where an s is not enough."""
    return f"{count:,} {noun if count == 1 else plural_noun or noun + 's'}"
