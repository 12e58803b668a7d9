"""Cells between the engine's allocation and the pool, on one device or across two.

The engine's pages are where vLLM put them (the GPU, or the host on a CPU engine); the pool is the
daemon's T0 (GPU memory, or host shared memory). Both on one GPU: one `copy_cells`
(kvtierd/movers/layout_kernels.py), one kernel launch whatever the ids and the size. Both on the
host: one `copy_rows` (kvtierd/movers/span_copy.py: a memcpy per span, adjacent cells coalesced, in
one call of the C extension with the GIL released), as fast as one memcpy of the bytes. Otherwise
(across devices, or on the host without the extension) the bytes pass through a buffer kept per
thread (`HostStaging`: a fresh allocation of hundreds of MiB costs more in page faults than the copy
itself), in chunks of its size: a gather where the bytes are, one transfer, a scatter where they go
(on the host alone a gather into it and a scatter out of it). Each chunk is a fixed number of steps
whatever the ids.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from kvtierd.movers import span_copy
from kvtierd.movers.layout_kernels import copy_cells

DEFAULT_CHUNK_NBYTES = 64 << 20  # the host buffer of a thread: 64 MiB moves at memcpy speed


class HostStaging:
    """Host buffers for the bytes between a gather and a scatter, one per thread, reused.

    Invariants: a thread's kept buffer serves one copy of that thread at a time (the worker's load
    and store threads copy concurrently, each with its own) and holds at most `chunk_nbytes`; a
    request above that (one cell larger than a chunk) gets a buffer used once; buffers are
    page-locked when `pinned` (an engine on CUDA: faster transfers).
    """

    def __init__(self, pinned: bool, chunk_nbytes: int = DEFAULT_CHUNK_NBYTES) -> None:
        self.pinned = pinned
        self.chunk_nbytes = chunk_nbytes
        self._local = threading.local()

    def buffer(self, nbytes: int) -> torch.Tensor:
        """A 1-D uint8 host tensor of `nbytes`, this thread's until its next call."""
        kept: torch.Tensor | None = getattr(self._local, "kept", None)
        if kept is not None and kept.numel() >= nbytes:
            return kept[:nbytes]
        fresh = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pinned)
        if nbytes <= self.chunk_nbytes:
            self._local.kept = fresh
        return fresh


def _check_cells(cells: torch.Tensor, buffer: torch.Tensor, cell_nbytes: int, what: str) -> None:
    num_cells = buffer.numel() // cell_nbytes
    if cells.numel() and (int(cells.min()) < 0 or int(cells.max()) >= num_cells):
        raise ValueError(f"{what} cells must be in [0, {num_cells})")


def _as_rows(buffer: torch.Tensor, cell_nbytes: int) -> torch.Tensor:
    """`buffer`'s whole cells as a row tensor (span_copy.py): uint8 `[cells, cell_nbytes]`."""
    return buffer[:buffer.numel() // cell_nbytes * cell_nbytes].view(-1, cell_nbytes)


def _one_step(dst: torch.Tensor, dst_cells: torch.Tensor | None, src: torch.Tensor, src_cells: torch.Tensor | None,
              cell_nbytes: int) -> None:
    """A copy of cells on the buffers' one device in one step, None meaning cell i: a kernel (CUDA), a
    call of span_copy's C extension (host), or torch's index ops where no side needs a staging buffer."""
    if dst.device.type == "cpu" and span_copy.native_available():
        named = dst_cells if dst_cells is not None else src_cells
        assert named is not None, "a copy names its cells on one side at least"
        ids = [np.arange(named.numel()) if cells is None else cells.numpy() for cells in (dst_cells, src_cells)]
        span_copy.copy_rows(_as_rows(dst, cell_nbytes), ids[0], _as_rows(src, cell_nbytes), ids[1])
    else:
        copy_cells(dst, dst_cells, src, src_cells, cell_nbytes)


def move_cells(dst: torch.Tensor, dst_cells: torch.Tensor, src: torch.Tensor, src_cells: torch.Tensor,
               cell_nbytes: int, staging: HostStaging) -> None:
    """Cell `dst_cells[i]` of `dst` = cell `src_cells[i]` of `src` (1-D uint8 buffers, 1-D int64 CPU
    ids), whatever devices the two buffers are on; every id is checked before a byte is written."""
    if dst_cells.numel() != src_cells.numel():
        raise ValueError(f"{dst_cells.numel()} destination cells for {src_cells.numel()} source cells")
    _check_cells(dst_cells, dst, cell_nbytes, "destination")
    _check_cells(src_cells, src, cell_nbytes, "source")
    if dst.device == src.device and (dst.device.type != "cpu" or span_copy.native_available()):
        _one_step(dst, dst_cells, src, src_cells, cell_nbytes)
        return
    cells_per_chunk = max(1, staging.chunk_nbytes // cell_nbytes)
    for start in range(0, dst_cells.numel(), cells_per_chunk):
        chunk_dst, chunk_src = dst_cells[start:start + cells_per_chunk], src_cells[start:start + cells_per_chunk]
        nbytes = chunk_dst.numel() * cell_nbytes
        if dst.device == src.device:  # the host, without span_copy's C extension
            copy_cells(dst, chunk_dst, src, chunk_src, cell_nbytes, staging=staging.buffer(nbytes))
            continue
        gathered = staging.buffer(nbytes) if src.device.type == "cpu" else \
            torch.empty(nbytes, dtype=torch.uint8, device=src.device)
        _one_step(gathered, None, src, chunk_src, cell_nbytes)  # where the bytes are
        if dst.device.type == "cpu":
            landed = staging.buffer(nbytes)
            landed.copy_(gathered)  # the one transfer
        else:
            landed = gathered.to(dst.device)  # the one transfer
        _one_step(dst, chunk_dst, landed, None, cell_nbytes)  # where they go
