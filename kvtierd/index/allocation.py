"""What the block index hands a request back: its block table on allocation, and where a write goes."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, slots=True)
class AllocatedBlocks:
    """The block table of a request: its prefix hits first, then fresh blocks."""

    block_ids: list[int]
    num_hit_blocks: int


@dataclasses.dataclass(frozen=True, slots=True)
class WriteTarget:
    """Where a write into a request's block goes; `copied_from` is set when it was copied first."""

    block_id: int
    copied_from: int | None
