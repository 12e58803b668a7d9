"""What the scheduler side asks the daemon for a request (`LookupQuery`), and the function that answers it
(`LookupFn`: daemon_lookup.py asks the daemon of every TP rank; tests pass their own)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from kvtierd.connectors.vllm.group_hits import RequestHit


@dataclasses.dataclass(frozen=True, slots=True)
class LookupQuery:
    """One lookup: every served group's keys of candidate positions [first, first + n), and their tokens."""

    first_position: int
    keys: tuple[tuple[bytes, ...], ...]  # per served group, in EngineGroups order
    token_ids: tuple[int, ...]  # block_size per candidate position
    count_query: bool = False  # the request's first lookup: the daemon counts it as a query
    hold_id: str = ""  # the request's id: the daemon holds the promised blocks until the load's Acquire names it

    @property
    def num_positions(self) -> int:
        return len(self.keys[0])


# One lookup, answered: the blocks beyond the engine's own hit that every group can serve.
LookupFn = Callable[[LookupQuery], RequestHit]
