"""Where the reference runner's KV blocks come from: the interface, and the private pool.

`KvBackend` is what ReferenceRunner asks for blocks. Two implementations:
- `KvtierdConnector` (runner_connector.py): the daemon's pool, mapped; prefixes cached
  before (by this process, another runner, or before a restart, from T0, T1 or T2) are
  restored instead of recomputed.
- `PrivateKv` (here): a pool of the runner's own with no cache at all, every prompt computed
  from scratch — "without kvtierd" in the demo and the benchmarks, and the recompute oracle.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import torch

from kvtierd.block_hash import PromptExtras
from kvtierd.errors import InvalidArgument, ResourceExhausted
from kvtierd.units import ceil_div


@dataclasses.dataclass(frozen=True, slots=True)
class StartedSequence:
    """A request's blocks once admitted: its table, and how much of the prompt is in them."""

    block_ids: list[int]
    num_cached_tokens: int  # leading prompt tokens whose KV the pool already holds
    num_t0_hit_tokens: int = 0
    num_t1_hit_tokens: int = 0
    num_t2_hit_tokens: int = 0
    num_t3_hit_tokens: int = 0


def num_blocks_for(num_tokens: int, block_size: int) -> int:
    return ceil_div(num_tokens, block_size)


class KvBackend(Protocol):
    block_size: int

    @property
    def pool(self) -> torch.Tensor:
        """The block-major pool `[num_blocks, num_layers, 2, block_size, kv_heads, head_dim]`."""
        ...

    def start(self, request_id: str, prompt_token_ids: list[int], extras: PromptExtras) -> StartedSequence:
        """Blocks for the prompt and the first generated token, with whatever the cache holds."""
        ...

    def grow(self, request_id: str, num_blocks: int) -> list[int]:
        """More blocks at the end of the request's table (decode past its last block)."""
        ...

    def write_target(self, request_id: str, position: int) -> int:
        """The block to write `position` into, copied first when it is shared (copy-on-write)."""
        ...

    def blocks_filled(self, request_id: str, token_ids: list[int], num_tokens_with_kv: int) -> None:
        """The pool now holds the KV of the first `num_tokens_with_kv` of `token_ids`."""
        ...

    def fork(self, request_id: str, child_request_id: str) -> list[int]:
        """A child sharing the request's blocks (n > 1 sampling); its block table."""
        ...

    def finish(self, request_id: str) -> None:
        """The request is done: its blocks go back."""
        ...

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        """A prefill forward computed `num_tokens` prompt tokens in `seconds` (the runner's measure
        of what recomputing costs, which a cache weighs its slower hits against)."""
        ...


class PrivateKv:
    """A runner-private pool with no prefix cache: every prompt is computed in full.

    Invariant: a block id is in `free_block_ids` or in exactly one request's table, never both;
    forks copy (nothing is shared, so nothing is ever written twice).
    """

    def __init__(self, layout, num_blocks: int, device: str | torch.device = "cpu") -> None:
        self.block_size = layout.block_size
        self._pool = torch.zeros((num_blocks, *layout.block_shape), dtype=layout.torch_dtype, device=device)
        self.free_block_ids = list(range(num_blocks - 1, -1, -1))  # pop() takes the lowest id
        self.tables: dict[str, list[int]] = {}

    @property
    def pool(self) -> torch.Tensor:
        return self._pool

    def _take(self, num_blocks: int) -> list[int]:
        if num_blocks > len(self.free_block_ids):
            raise ResourceExhausted(f"the private pool has {len(self.free_block_ids)} free blocks, "
                                    f"{num_blocks} are needed")
        return [self.free_block_ids.pop() for _ in range(num_blocks)]

    def start(self, request_id: str, prompt_token_ids: list[int], extras: PromptExtras) -> StartedSequence:
        if request_id in self.tables:
            raise InvalidArgument(f"request {request_id!r} is already running")
        self.tables[request_id] = self._take(num_blocks_for(len(prompt_token_ids) + 1, self.block_size))
        return StartedSequence(list(self.tables[request_id]), 0)

    def grow(self, request_id: str, num_blocks: int) -> list[int]:
        new_block_ids = self._take(num_blocks)
        self.tables[request_id].extend(new_block_ids)
        return new_block_ids

    def write_target(self, request_id: str, position: int) -> int:
        return self.tables[request_id][position // self.block_size]

    def blocks_filled(self, request_id: str, token_ids: list[int], num_tokens_with_kv: int) -> None:
        pass  # nothing is cached

    def fork(self, request_id: str, child_request_id: str) -> list[int]:
        table = self.tables[request_id]
        copies = self._take(len(table))
        self._pool[copies] = self._pool[table]
        self.tables[child_request_id] = copies
        return list(copies)

    def finish(self, request_id: str) -> None:
        self.free_block_ids.extend(reversed(self.tables.pop(request_id)))

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        pass  # nothing is cached, so nothing is weighed
