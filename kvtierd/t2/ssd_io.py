"""Block bytes to and from the SSD tier's slot files: the blocks a store is given, checked; their
bytes written run by run on the I/O threads, with a checksum each; read back run by run, each
block verified against the checksum its slot was written with.

A read that fails (an OSError: "io") or comes back short or with another checksum ("corrupt")
zeroes the caller's row: nothing of a failed block is handed out.

With a sealer (encryption on: kvtierd/sealing/block_seal.py) each block is sealed on its way out
into a staged record (nonce | ciphertext | tag, the files' `slot_nbytes`) and opened on its way in:
the GCM tag verifies it, so no checksum is kept (0), and a record that does not open as its key's
(moved, altered, its tenant forgotten) fails as "unauthentic", its row zeroed like any failure.

`write` and `read` wait for every run before returning or raising (a slot must not be freed while
a write to it is in flight).
"""

from __future__ import annotations

import concurrent.futures
import logging
import mmap
import threading
from collections.abc import Callable, Sequence
from typing import Literal, TypeVar, cast

import numpy as np
import torch
import xxhash

from kvtierd.daemon_key import DaemonKey
from kvtierd.errors import InvalidArgument
from kvtierd.index.slot_entry import BlockMeta, SlotEntry
from kvtierd.sealing.block_seal import SEAL_OVERHEAD_BYTES, BlockSealer
from kvtierd.t2.ssd_files import Run, SlotFiles

log = logging.getLogger(__name__)
T = TypeVar("T")
BlockBytes = torch.Tensor | bytes | bytearray | memoryview  # a block's bytes as `store` takes them
ReadResult = Literal[True] | str  # True, or why the block failed: "io", "corrupt" or "unauthentic"


class SlotIO:
    """`checksums[slot]`: the xxh3-64 of the bytes its holder was written with (the tier sets it;
    0 when sealed). `block_nbytes`: a block's bytes as callers hand them over, the files' slot less
    the seal's overhead when sealed."""

    def __init__(self, files: SlotFiles, num_io_threads: int, checksums: np.ndarray,
                 sealer: BlockSealer | None = None) -> None:
        self.files, self.checksums, self.sealer = files, checksums, sealer
        self.block_nbytes = files.slot_nbytes - (SEAL_OVERHEAD_BYTES if sealer is not None else 0)
        self._pool = concurrent.futures.ThreadPoolExecutor(num_io_threads, thread_name_prefix="kvtierd-ssd-io")
        self._records = threading.local()  # per I/O thread: an aligned buffer of sealed records

    def write(self, entries: list[SlotEntry], sources: list[memoryview]) -> list[int]:
        """Write each entry's source into its slot; each one's checksum."""
        return self._run_all(self._write_run, entries, sources)

    def read(self, entries: list[SlotEntry], destinations: list[memoryview]) -> list[ReadResult]:
        """Read each entry's slot into its destination, verified; True or why it failed, each."""
        return self._run_all(self._read_run, entries, destinations)

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def _write_run(self, run: Run, entries: list[SlotEntry], sources: list[memoryview]) -> list[tuple[int, int]]:
        if self.sealer is None:
            self.files.write_run(run, sources)
            return [(p, xxhash.xxh3_64_intdigest(sources[p])) for p in run.positions]
        sealed = self._staged(run, sources)
        record_nbytes = self.files.slot_nbytes
        for position in run.positions:
            record = sealed[position]
            self.sealer.seal_into(entries[position].block_hash, sources[position], record[:record_nbytes])
            record[record_nbytes:] = bytes(record.nbytes - record_nbytes)
        self.files.write_run(run, sealed)
        return [(p, 0) for p in run.positions]

    def _read_run(self, run: Run, entries: list[SlotEntry],
                  destinations: list[memoryview]) -> list[tuple[int, ReadResult]]:
        try:
            views = self.files.read_run(run, destinations if self.sealer is None else self._staged(run, destinations))
            failure = "corrupt"  # a short read (view None)
        except OSError as error:
            log.error("SSD tier: read of %d block(s) failed: %s", len(run.positions), error)
            views, failure = [None] * len(run.positions), "io"
        results: list[tuple[int, ReadResult]] = []
        for position, view in zip(run.positions, views):
            destination = destinations[position]
            outcome = failure if view is None else self._accept(entries[position], view, destination)
            if outcome is not True:
                destination[:] = bytes(destination.nbytes)  # nothing of a failed block is handed out
            results.append((position, outcome))
        return results

    def _accept(self, entry: SlotEntry, view: memoryview, destination: memoryview) -> ReadResult:
        """Verify a slot's bytes as `entry`'s and hand the block into `destination`: True, or why not."""
        if self.sealer is not None:
            return True if self.sealer.open_into(entry.block_hash, view, destination) else "unauthentic"
        if xxhash.xxh3_64_intdigest(view) != int(self.checksums[entry.slot]):
            return "corrupt"
        if view.obj is not destination.obj:
            destination[:] = view
        return True

    def _staged(self, run: Run, buffers: list[memoryview]) -> list[memoryview]:
        """`buffers` with the run's positions replaced by one stride each of this thread's aligned
        record buffer (sealed records are staged there on their way to and from the files)."""
        stride = self.files.stride
        view = getattr(self._records, "view", None)
        if view is None:
            view = self._records.view = memoryview(mmap.mmap(-1, self.files.chunk_blocks * stride))
        staged = list(buffers)
        for j, position in enumerate(run.positions):
            staged[position] = view[j * stride:(j + 1) * stride]
        return staged

    def _run_all(self, task: Callable[[Run, list[SlotEntry], list[memoryview]], list[tuple[int, T]]],
                 entries: list[SlotEntry], buffers: list[memoryview]) -> list[T]:
        """Run `task(run, entries, buffers)` per run, the last on this thread and the others on the I/O
        threads (a write of one run hands nothing over); wait for every one."""
        runs = self.files.plan_runs([e.slot for e in entries])
        futures = [self._pool.submit(task, run, entries, buffers) for run in runs[:-1]]
        try:
            outcomes = [task(runs[-1], entries, buffers)] if runs else []
        finally:
            concurrent.futures.wait(futures)  # even when this thread's run failed: no I/O left running
        results = cast("list[T]", [None] * len(entries))  # each position is set below, or this raises
        for outcome in [*(future.result() for future in futures), *outcomes]:  # re-raises the first failure
            for position, value in outcome:
                results[position] = value
        return results


def checked_rows(out: torch.Tensor | Sequence[torch.Tensor], num_blocks: int, slot_nbytes: int) -> list[torch.Tensor]:
    """The rows a load reads `num_blocks` blocks into: `out`'s first rows (a uint8 tensor `[>= n,
    slot_nbytes]`) or its n rows; InvalidArgument unless each is a CPU uint8 row of `slot_nbytes`
    contiguous bytes."""
    rows = list(out[:num_blocks]) if isinstance(out, torch.Tensor) else list(out)
    if len(rows) < num_blocks or not all(
            isinstance(row, torch.Tensor) and row.dtype == torch.uint8 and row.device.type == "cpu"
            and row.shape == (slot_nbytes,) and row.is_contiguous() for row in rows):
        raise InvalidArgument(f"out must be CPU uint8 rows of {slot_nbytes} contiguous bytes, at least {num_blocks}")
    return rows


def checked_blocks(items: Sequence[tuple[BlockMeta, BlockBytes]],
                   slot_nbytes: int) -> tuple[list[BlockMeta], dict[DaemonKey, memoryview]]:
    """The metas of a store's items and a view of each block's bytes (the first, for a key given
    twice); InvalidArgument for an item that is not (BlockMeta, `slot_nbytes` bytes)."""
    metas, sources = [], {}
    for meta, data in items:
        if not isinstance(meta, BlockMeta):
            raise InvalidArgument(f"store items are (BlockMeta, bytes), got {type(meta).__name__}")
        if isinstance(data, torch.Tensor):
            if data.dtype != torch.uint8 or data.device.type != "cpu":
                raise InvalidArgument("a block tensor must be a CPU uint8 tensor")
            view = data.contiguous().view(-1).numpy().data
        else:
            try:
                view = memoryview(data).cast("B")
            except TypeError as error:
                raise InvalidArgument(f"block data must be bytes-like or a tensor: {error}") from None
        if view.nbytes != slot_nbytes:
            raise InvalidArgument(f"a block is {slot_nbytes} bytes here, got {view.nbytes}")
        metas.append(meta)
        sources.setdefault(meta.block_hash, view)
    return metas, sources
