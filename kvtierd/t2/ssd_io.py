"""Block bytes to and from the SSD tier's slot files: the blocks a store is given, checked; their
bytes written run by run on the I/O threads, with a checksum each; read back run by run, each
block verified against the checksum its slot was written with.

A read that fails (an OSError: "io") or comes back short or with another checksum ("corrupt")
zeroes the caller's row: nothing of a failed block is handed out. `write` and `read` wait for
every run before returning or raising (a slot must not be freed while a write to it is in
flight).
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Callable, Sequence
from typing import Literal, TypeVar, cast

import numpy as np
import torch
import xxhash

from kvtierd.daemon_key import DaemonKey
from kvtierd.errors import InvalidArgument
from kvtierd.index.slot_entry import BlockMeta, SlotEntry
from kvtierd.t2.ssd_files import Run, SlotFiles

log = logging.getLogger(__name__)
T = TypeVar("T")
BlockBytes = torch.Tensor | bytes | bytearray | memoryview  # a block's bytes as `store` takes them
ReadResult = Literal[True] | str  # True, or why the block failed: "io" or "corrupt"


class SlotIO:
    """`checksums[slot]`: the xxh3-64 of the bytes its holder was written with (the tier sets it)."""

    def __init__(self, files: SlotFiles, num_io_threads: int, checksums: np.ndarray) -> None:
        self.files, self.checksums = files, checksums
        self._pool = concurrent.futures.ThreadPoolExecutor(num_io_threads, thread_name_prefix="kvtierd-ssd-io")

    def write(self, entries: list[SlotEntry], sources: list[memoryview]) -> list[int]:
        """Write each entry's source into its slot; each one's checksum."""
        return self._run_all(self._write_run, entries, sources)

    def read(self, entries: list[SlotEntry], destinations: list[memoryview]) -> list[ReadResult]:
        """Read each entry's slot into its destination, verified; True or why it failed, each."""
        return self._run_all(self._read_run, entries, destinations)

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def _write_run(self, run: Run, entries: list[SlotEntry], sources: list[memoryview]) -> list[tuple[int, int]]:
        self.files.write_run(run, sources)
        return [(p, xxhash.xxh3_64_intdigest(sources[p])) for p in run.positions]

    def _read_run(self, run: Run, entries: list[SlotEntry],
                  destinations: list[memoryview]) -> list[tuple[int, ReadResult]]:
        try:
            views = self.files.read_run(run, destinations)
            failure = "corrupt"  # a short read (view None) or a checksum mismatch
        except OSError as error:
            log.error("SSD tier: read of %d block(s) failed: %s", len(run.positions), error)
            views, failure = [None] * len(run.positions), "io"
        results: list[tuple[int, ReadResult]] = []
        for position, view in zip(run.positions, views):
            destination = destinations[position]
            if view is not None and xxhash.xxh3_64_intdigest(view) == int(self.checksums[entries[position].slot]):
                if view.obj is not destination.obj:
                    destination[:] = view
                results.append((position, True))
            else:
                destination[:] = bytes(destination.nbytes)  # nothing of a failed block is handed out
                results.append((position, failure))
        return results

    def _run_all(self, task: Callable[[Run, list[SlotEntry], list[memoryview]], list[tuple[int, T]]],
                 entries: list[SlotEntry], buffers: list[memoryview]) -> list[T]:
        """Run `task(run, entries, buffers)` per run on the I/O threads; wait for every one."""
        runs = self.files.plan_runs([e.slot for e in entries])
        futures = [self._pool.submit(task, run, entries, buffers) for run in runs]
        concurrent.futures.wait(futures)
        results = cast("list[T]", [None] * len(entries))  # each position is set below, or this raises
        for future in futures:
            for position, value in future.result():  # re-raises the first failure
                results[position] = value
        return results


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
