"""How much a pool holds: blocks and tokens from a byte budget, concurrency at a request length.

The lines an operator plans with (printed at start-up and by the simulator), after vLLM's
"GPU KV cache size: N tokens" and "Maximum concurrency for L tokens per request: X×".
Concurrency counts whole blocks per request, so it already pays the last block's waste.
"""

from __future__ import annotations

import dataclasses

from kvtierd.errors import InvalidArgument
from kvtierd.layout import Layout
from kvtierd.planning.fragmentation import fragmentation, num_slots


@dataclasses.dataclass(frozen=True, slots=True)
class PoolCapacity:
    """A pool of `num_blocks` blocks of one layout."""

    layout: Layout
    num_blocks: int

    @classmethod
    def from_budget(cls, layout: Layout, budget_bytes: int | float, utilization: float = 1.0) -> PoolCapacity:
        """The blocks that fit in `utilization` of `budget_bytes`."""
        if budget_bytes < 0 or not 0 < utilization <= 1:
            raise InvalidArgument(
                f"need budget_bytes >= 0 and 0 < utilization <= 1, got {budget_bytes}, {utilization}")
        return cls(layout, int(budget_bytes * utilization) // layout.bytes_per_block)

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.layout.bytes_per_block

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.layout.block_size

    def blocks_per_request(self, num_tokens: int) -> int:
        if num_tokens <= 0:
            raise InvalidArgument(f"a request length must be positive, got {num_tokens}")
        return num_slots(num_tokens, self.layout.block_size) // self.layout.block_size

    def max_concurrency(self, num_tokens: int) -> float:
        """Requests of `num_tokens` that fit at once (fractional, as vLLM prints it)."""
        return self.num_blocks / self.blocks_per_request(num_tokens)

    def max_requests(self, num_tokens: int) -> int:
        """Whole requests of `num_tokens` that fit at once."""
        return self.num_blocks // self.blocks_per_request(num_tokens)

    def lines(self, tier: str, request_tokens: int) -> list[str]:
        """The capacity lines for this pool at one request length."""
        layout = self.layout
        frag = fragmentation([request_tokens], layout.block_size)
        return [
            f"{tier}: {self.num_blocks:,} blocks = {self.num_tokens:,} tokens ({format_bytes(self.nbytes)})",
            f"{tier}: maximum concurrency for {request_tokens:,} tokens per request: "
            f"{self.max_concurrency(request_tokens):,.2f}x ({frag.num_allocated_slots:,} slots each; "
            f"waste {frag.waste_per_allocated_slot:.1%} per allocated slot, "
            f"{frag.waste_per_effective_token:.1%} per effective token)",
        ]


def layout_lines(layout: Layout) -> list[str]:
    """What one token and one block of this layout cost."""
    return [
        f"layout {layout.model_id}: {layout.num_layers} layers x {layout.num_kv_heads} KV heads x "
        f"{layout.head_dim} dims, {layout.dtype}, block {layout.block_size} tokens",
        f"KV bytes per token: {layout.bytes_per_token:,} ({format_bytes(layout.bytes_per_token)}); "
        f"per block: {layout.bytes_per_block:,} ({format_bytes(layout.bytes_per_block)})",
    ]


def format_bytes(num_bytes: int | float) -> str:
    """Binary units: 2097152 → '2.0 MiB'."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
