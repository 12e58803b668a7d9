"""One forward pass's inputs: the new tokens of several sequences and where their KV lives.

A `SequenceChunk` is the part of one sequence this pass computes: tokens from `start_position`
on, with the sequence's block table. Tokens before `num_cached_tokens` already have their KV in
the pool (restored from the daemon, or computed earlier): they are attended to and, if in the
chunk (the last prompt token recomputed for its logits when the whole prompt hit), their query
is computed but their KV is not rewritten, so a committed (shared, immutable) block is never
written.
"""

from __future__ import annotations

import dataclasses

import torch

from kvtierd.connectors.reference.paged_attention_metadata import PagedAttentionMetadata
from kvtierd.errors import InvalidArgument


@dataclasses.dataclass(frozen=True, slots=True)
class SequenceChunk:
    token_ids: list[int]  # the tokens this pass computes
    start_position: int  # the position of token_ids[0] in its sequence
    block_table: list[int]  # the sequence's pool block ids, in order
    num_cached_tokens: int = 0  # positions below this already hold KV: not written again

    @property
    def end_position(self) -> int:
        return self.start_position + len(self.token_ids)


@dataclasses.dataclass(frozen=True, slots=True)
class ForwardBatch:
    """Flattened ("varlen") tensors for LlamaModel.forward, and the attention metadata built from them.

    Invariants: `query_start_loc[-1] == len(input_ids)`; `context_lens[s]` is the end position of
    sequence s's chunk; `slot_block_ids` / `slot_offsets` address, in order, the tokens selected by
    `write_token_index`, each inside its sequence's block table.
    """

    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    query_start_loc: torch.Tensor  # [num_seqs + 1] int64
    context_lens: torch.Tensor  # [num_seqs] int64
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int64, padded with 0 (never read past context)
    write_token_index: torch.Tensor  # [num_writes] int64: which tokens' KV is stored
    slot_block_ids: torch.Tensor  # [num_writes] int64
    slot_offsets: torch.Tensor  # [num_writes] int64
    last_token_index: torch.Tensor  # [num_seqs] int64: each sequence's last token, for its logits
    attention: PagedAttentionMetadata  # the same tables, lengths and starts, grouped for every layer's attention
    writes_every_token: bool  # write_token_index is 0 .. num_tokens - 1 (no cached token recomputed)

    @classmethod
    def build(cls, chunks: list[SequenceChunk], block_size: int, device: torch.device | str = "cpu") -> ForwardBatch:
        if not chunks:
            raise InvalidArgument("a forward pass needs at least one sequence")
        input_ids, positions, starts, context_lens = [], [], [0], []
        write_index, slot_blocks, slot_offsets = [], [], []
        for chunk in chunks:
            if not chunk.token_ids:
                raise InvalidArgument("every sequence of a forward pass needs at least one token")
            end = chunk.end_position
            if len(chunk.block_table) * block_size < end:
                raise InvalidArgument(f"a block table of {len(chunk.block_table)} blocks cannot hold {end} tokens")
            base = len(input_ids)
            input_ids.extend(chunk.token_ids)
            positions.extend(range(chunk.start_position, end))
            for i, position in enumerate(range(max(chunk.start_position, chunk.num_cached_tokens), end),
                                         start=max(0, chunk.num_cached_tokens - chunk.start_position)):
                write_index.append(base + i)
                slot_blocks.append(chunk.block_table[position // block_size])
                slot_offsets.append(position % block_size)
            starts.append(len(input_ids))
            context_lens.append(end)
        max_blocks = max(len(chunk.block_table) for chunk in chunks)
        tables = [chunk.block_table + [0] * (max_blocks - len(chunk.block_table)) for chunk in chunks]
        last_token_index = [start - 1 for start in starts[1:]]
        fields = (input_ids, positions, starts, context_lens, [b for table in tables for b in table], write_index,
                  slot_blocks, slot_offsets, last_token_index)
        # One host-to-device copy for all of them (each its own copy would be a dozen on a GPU).
        flat = torch.tensor([v for field in fields for v in field], dtype=torch.int64).to(device)
        ids, pos, query_starts, lens, table_ids, writes, blocks, offsets, last = flat.split([len(f) for f in fields])
        return cls(ids, pos, query_starts, lens, table_ids.view(len(tables), max_blocks), writes, blocks, offsets, last,
                   PagedAttentionMetadata.build(tables, context_lens, starts, block_size, device),
                   writes_every_token=write_index == list(range(len(input_ids))))
