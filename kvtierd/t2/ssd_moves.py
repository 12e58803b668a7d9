"""Blocks moved from slot to slot within one SSD tier's files, for a give-back (ssd_growth.py).

Each block is read from its old slot and verified against the checksum it was written with, then
written at its new slot (the same bytes: the same checksum) and, with `durable`, synced: all of it
before the caller commits records that name the new slots. Batches of at most MOVE_BATCH_BYTES go
through one page-aligned buffer. A block whose read fails or does not verify cannot move ("io",
"corrupt"); a write or sync that fails fails every move not failed already ("write": the disk is
failing, and what was written is not known to be durable). The old slots are left as they are: the
records still name them until the caller commits.
"""

from __future__ import annotations

import dataclasses
import mmap
from collections.abc import Sequence
from typing import Literal

from kvtierd.index.slot_entry import SlotEntry
from kvtierd.t2.ssd_files import SlotFiles
from kvtierd.t2.ssd_io import SlotIO

MOVE_BATCH_BYTES = 32 << 20  # read then written at a time (or one block, if larger)

MoveResult = Literal[True] | str  # True, or why the block did not move: "io", "corrupt" (its read), "write"
Move = tuple[SlotEntry, int, int]  # (entry, its slot now, the slot it moves to): ExtentSlotIndex's Shrink.moves


@dataclasses.dataclass(frozen=True, slots=True)
class MoveOutcome:
    """Per move, in the caller's order: whether it landed, and the checksum of its bytes at the new slot."""

    results: list[MoveResult]
    checksums: list[int]  # 0 where the block did not move
    write_error: OSError | None  # the first write or sync that failed


class SlotMover:
    """Copies blocks between slots of `files` through `io` (whose checksums are the tier's, per
    slot: a moved block's new slot gets its checksum once written). The caller holds both slots of
    each move (ExtentSlotIndex.plan_shrink: the entry is invisible, its new slot reserved), so
    nobody else reads or writes them meanwhile."""

    def __init__(self, files: SlotFiles, io: SlotIO, durable: bool, batch_bytes: int = MOVE_BATCH_BYTES) -> None:
        self.files, self.io, self.durable = files, io, durable
        self.batch_blocks = max(1, batch_bytes // files.stride)

    def move(self, moves: Sequence[Move]) -> MoveOutcome:
        """Move each block; blocking (a shed's thread), the I/O threads do the reads and writes."""
        results: list[MoveResult] = ["write"] * len(moves)
        checksums = [0] * len(moves)
        if not moves:
            return MoveOutcome(results, checksums, None)
        stride, nbytes = self.files.stride, self.io.block_nbytes
        view = memoryview(mmap.mmap(-1, min(len(moves), self.batch_blocks) * stride))  # freed with its last view
        written: list[int] = []  # positions written, not yet synced
        try:
            for start in range(0, len(moves), self.batch_blocks):
                batch = range(start, min(len(moves), start + self.batch_blocks))
                rows = [view[j * stride:j * stride + nbytes] for j in range(len(batch))]
                read = self.io.read([moves[p][0] for p in batch], rows)  # verified at the old slots
                good = [j for j, ok in enumerate(read) if ok is True]
                for j, ok in enumerate(read):
                    if ok is not True:
                        results[batch[j]] = ok
                # entries at the new slots, for the I/O's slot map only
                targets = [SlotEntry(moves[batch[j]][0].meta, moves[batch[j]][2]) for j in good]
                for j, checksum in zip(good, self.io.write(targets, [rows[j] for j in good])):
                    checksums[batch[j]] = checksum
                    written.append(batch[j])
            if self.durable and written:
                self.files.sync([self.files.location(moves[p][2])[0] for p in written])
        except OSError as error:
            return MoveOutcome(results, [0] * len(moves), error)
        for p in written:
            results[p] = True
            self.io.checksums[moves[p][2]] = checksums[p]
        return MoveOutcome(results, checksums, None)
