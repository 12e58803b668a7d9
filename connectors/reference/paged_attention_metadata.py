"""What paged attention needs to know about a varlen batch, worked out once per forward pass.

`PagedAttentionMetadata.build` reads a batch's block tables, context lengths and query starts
(paged_attention.py's docstring gives their meaning) as host integers, checks them, and sorts
the sequences into groups, each computed by one `scaled_dot_product_attention` call per layer:

- causal groups: sequences computed from their first token (num_queries == context_len > 1),
  one group per length: SDPA with `is_causal` over the gathered keys (flash attention on CUDA);
- masked groups: the others, with keys before their first query (a cached prefix) or one query
  (a decode step), one group per number of queries: keys padded to the group's longest
  context, and a boolean mask for the causal, bottom-right aligned positions and the padding
  (none for a decode group whose contexts are all equal);
- sequences without queries belong to no group.

The layers then neither read the metadata back from the device nor loop over sequences: per
group, one gather of its blocks for K, one for V, one SDPA call.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from kvtierd.errors import InvalidArgument
from kvtierd.units import ceil_div


@dataclasses.dataclass(slots=True)
class AttentionGroup:
    """Sequences computed by one SDPA call, with the same number of queries each.

    Invariants: `block_ids` holds `num_seqs * num_blocks` ids, sequence-major, each sequence's
    blocks then 0 as padding (masked, never attended to); `num_blocks * block_size >= num_keys`,
    the group's longest context; `token_rows` names the group's `num_seqs * num_queries` query
    rows in the batch, sequence-major. Causal groups have `num_queries == num_keys` and no
    `last_key_positions`; `_masks` is filled on first use, by GQA group size, and never changes.
    `_gather_buffers` hold the gathered K and V of one layer at a time: every layer of the pass
    gathers into the same two, so the metadata serves one forward pass on one stream (a layer's
    gather is ordered after the previous layer's reads).
    """

    causal: bool
    num_seqs: int
    num_queries: int  # per sequence
    num_keys: int  # keys per sequence after padding: the group's longest context
    block_ids: torch.Tensor  # [num_seqs * num_blocks] int64, on the batch's device
    token_rows: slice | torch.Tensor  # a slice when the rows are consecutive, else int64 row ids
    context_lens: torch.Tensor  # [num_seqs] int64: each sequence's context, <= num_keys
    last_key_positions: torch.Tensor | None  # [num_seqs, num_queries] int64: the last key each query sees
    _masks: dict[int, torch.Tensor | None] = dataclasses.field(default_factory=dict)
    _gather_buffers: dict[tuple, torch.Tensor] = dataclasses.field(default_factory=dict)

    def gather_buffer(self, slot: int, shape: tuple[int, ...], dtype: torch.dtype,
                      device: torch.device) -> torch.Tensor:
        """Scratch for gathering K (slot 0) or V (slot 1), made on first use, then reused: fresh
        memory for every layer's copy costs more than the copy on a CPU (its pages fault in)."""
        key = (slot, shape, dtype, device)
        if key not in self._gather_buffers:
            self._gather_buffers[key] = torch.empty(shape, dtype=dtype, device=device)
        return self._gather_buffers[key]

    def key_mask(self, num_heads_per_kv_head: int) -> torch.Tensor | None:
        """The boolean mask for queries packed as `[num_seqs, kv_heads, num_queries * group, keys]`
        (query i's heads of one KV head in consecutive rows): `[num_seqs, 1, rows, num_keys]`, or
        `[num_seqs, 1, 1, num_keys]` for one query (broadcast over the heads); None when no key is
        masked."""
        if num_heads_per_kv_head not in self._masks:
            self._masks[num_heads_per_kv_head] = self._build_mask(num_heads_per_kv_head)
        return self._masks[num_heads_per_kv_head]

    def _build_mask(self, num_heads_per_kv_head: int) -> torch.Tensor | None:
        positions = self.last_key_positions
        if positions is None:
            return None
        if self.num_queries > 1:
            positions = positions.repeat_interleave(num_heads_per_kv_head, dim=1)
        key_positions = torch.arange(self.num_keys, device=positions.device)
        return key_positions <= positions[:, None, :, None]


@dataclasses.dataclass(frozen=True, slots=True)
class PagedAttentionMetadata:
    """A checked varlen batch, grouped for SDPA. Immutable once built (a group's masks are built
    once, on first use). `max_block_id` is the largest block id any query reads (-1: none); the
    cache must hold it."""

    num_tokens: int
    block_size: int
    max_block_id: int
    groups: tuple[AttentionGroup, ...]

    @classmethod
    def build(cls, block_tables, context_lens, query_start_loc, block_size: int,
              device: torch.device | str = "cpu") -> PagedAttentionMetadata:
        """From lists or int32/int64 tensors (a tensor on the GPU is read back once, here).

        InvalidArgument for a batch that does not describe itself consistently; entries of a table
        past its sequence's context (padding, -1 in vLLM) and tables of sequences without queries
        are never read, so they are not checked.
        """
        if not isinstance(block_size, int) or block_size < 1:
            raise InvalidArgument(f"block_size must be a positive integer, got {block_size!r}")
        lens = _int_list(context_lens, "context_lens", 1)
        starts = _int_list(query_start_loc, "query_start_loc", 1)
        tables = _int_list(block_tables, "block_tables", 2)
        num_seqs = len(lens)
        if len(starts) != num_seqs + 1 or len(tables) != num_seqs:
            raise InvalidArgument(f"{num_seqs} context lengths need {num_seqs + 1} query starts and {num_seqs} "
                                  f"block tables, got {len(starts)} and {len(tables)}")
        if starts[0] != 0 or any(b < a for a, b in zip(starts, starts[1:])):
            raise InvalidArgument(f"query_start_loc must rise from 0 to the number of query tokens, got {starts}")
        causal: dict[int, list[int]] = {}  # length -> sequences
        masked: dict[int, list[int]] = {}  # queries per sequence -> sequences
        max_block_id = -1
        for seq, (context_len, table) in enumerate(zip(lens, tables)):
            num_queries = starts[seq + 1] - starts[seq]
            if num_queries == 0:
                continue
            if num_queries > context_len:
                raise InvalidArgument(f"sequence {seq} has {num_queries} queries but a context of {context_len}")
            blocks_read = table[:ceil_div(context_len, block_size)]
            if len(blocks_read) * block_size < context_len:
                raise InvalidArgument(f"sequence {seq} reads {ceil_div(context_len, block_size)} blocks but "
                                      f"block_tables has {len(table)} columns")
            if min(blocks_read) < 0:
                raise InvalidArgument(f"block ids must not be negative, sequence {seq} reads {min(blocks_read)}")
            max_block_id = max(max_block_id, *blocks_read)
            (causal if 1 < num_queries == context_len else masked).setdefault(num_queries, []).append(seq)
        device = torch.device(device)
        groups = [_group(True, seqs, lens, starts, tables, block_size, device) for seqs in causal.values()]
        groups += [_group(False, seqs, lens, starts, tables, block_size, device) for seqs in masked.values()]
        return cls(starts[-1], block_size, max_block_id, tuple(groups))


def _int_list(values, name: str, dim: int) -> list:
    """`values` (a tensor of `dim` dims, or nested sequences) as Python ints."""
    if isinstance(values, torch.Tensor):
        if values.dim() != dim or values.dtype not in (torch.int32, torch.int64):
            raise InvalidArgument(f"{name} must be a {dim}-D int32/int64 tensor, got {values.dtype} "
                                  f"{tuple(values.shape)}")
        return values.tolist()
    if not isinstance(values, Sequence) or (dim == 2 and not all(isinstance(row, Sequence) for row in values)):
        raise InvalidArgument(f"{name} must be a {dim}-D int32/int64 tensor or nested lists of ints")
    return [list(row) for row in values] if dim == 2 else list(values)


def _group(causal: bool, seqs: list[int], lens: list[int], starts: list[int], tables: list[list[int]],
           block_size: int, device: torch.device) -> AttentionGroup:
    num_queries = starts[seqs[0] + 1] - starts[seqs[0]]
    num_keys = max(lens[seq] for seq in seqs)
    num_blocks = ceil_div(num_keys, block_size)
    block_ids = []
    for seq in seqs:
        own = tables[seq][:ceil_div(lens[seq], block_size)]
        block_ids += own + [0] * (num_blocks - len(own))
    rows = [row for seq in seqs for row in range(starts[seq], starts[seq + 1])]
    if rows == list(range(rows[0], rows[0] + len(rows))):
        token_rows: slice | torch.Tensor = slice(rows[0], rows[0] + len(rows))
    else:
        token_rows = torch.tensor(rows, dtype=torch.int64, device=device)
    last_key_positions = None
    if not causal and (num_queries > 1 or any(lens[seq] != num_keys for seq in seqs)):
        last_key_positions = torch.tensor([[lens[seq] - num_queries + i for i in range(num_queries)] for seq in seqs],
                                          dtype=torch.int64, device=device)
    return AttentionGroup(causal, len(seqs), num_queries, num_keys,
                          torch.tensor(block_ids, dtype=torch.int64, device=device), token_rows,
                          torch.tensor([lens[seq] for seq in seqs], dtype=torch.int64, device=device),
                          last_key_positions)
