"""Where a group's pages lie in the engine's allocation, as cells: the index arithmetic that lets one
copy move a group's blocks between engine pages and pool slots, whatever the ids and the layout.

A layer's page of engine block e (engine_pages.py `_page_view`) is one span of `page_nbytes` bytes at
`base + e * block_stride`, or, where heads lie outside blocks (LHBNC, BHLNC), a few equal spans at a
fixed stride. Seen as an array of cells of `cell_nbytes` bytes, the largest size that every page
offset, block stride and span length is a multiple of, each page is a fixed list of cells shifted by
`e * block_stride / cell_nbytes`; a pool slot's row j is `page_nbytes / cell_nbytes` consecutive
cells. Turning (block ids, pool ids) into two cell id lists is a few tensor ops, the same number for
any ids; the copy itself is one gather-and-scatter (kvtierd/movers/layout_kernels.py `copy_cells`).
vLLM 0.32 places every layer in one allocation (vllm/v1/worker/utils.py `allocate_kv_cache`), so a
group is one `PageCells`; layers in allocations of their own make one each.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch

from kvtierd.connectors.vllm.kv_groups import UnsupportedModel

MIN_CELL_NBYTES = 16  # below this the cell ids would outweigh the bytes they move


def _storage_bytes(page: torch.Tensor) -> torch.Tensor:
    """The whole allocation under `page`, as a 1-D uint8 tensor."""
    storage = page.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=page.device).set_(storage, 0, (storage.nbytes(),), (1,))


def _spans(page: torch.Tensor) -> tuple[list[tuple[int, int]], int]:
    """(size, byte stride) of the page's outer dims, outermost first, and the bytes of its innermost
    contiguous span. `page` is uint8, its dims in memory order (engine_pages.py `_page_view`)."""
    dims = [(size, stride) for size, stride in zip(page.shape, page.stride()) if size != 1]
    span_nbytes = 1
    while dims and dims[-1][1] == span_nbytes:
        span_nbytes *= dims.pop()[0]
    return dims, span_nbytes


@dataclasses.dataclass(frozen=True)
class PageCells:
    """The pages of some of a group's layers (those in one allocation), as cells of it.

    Invariants: `storage` is the allocation as 1-D uint8 bytes; layer `rows[k]` of the group (its
    row in a pool slot) has the page of engine block e at the cells `first_cells[k] + e *
    block_stride_cells[k]`, in the page's memory order; every such cell of every engine block lies
    in `storage`; `cell_nbytes` divides the page size. The tensors are on the CPU: ids are built and
    checked there, then copied to the device once per call.
    """

    storage: torch.Tensor
    rows: torch.Tensor  # [num_rows] int64
    first_cells: torch.Tensor  # [num_rows, cells per page] int64: engine block 0's page
    block_stride_cells: torch.Tensor  # [num_rows] int64
    cell_nbytes: int

    def engine_cells(self, engine_block_ids: torch.Tensor) -> torch.Tensor:
        """The cells of the given blocks' pages, block-major then row then memory order: `[n * rows * cells]`."""
        block_offsets = engine_block_ids[:, None, None] * self.block_stride_cells[None, :, None]
        return (block_offsets + self.first_cells[None]).reshape(-1)

    def pool_cells(self, pool_block_ids: torch.Tensor, slot_num_layers: int) -> torch.Tensor:
        """The cells of the given pool slots' rows, in `engine_cells`' order, in a pool seen as cells."""
        cells_per_page = self.first_cells.shape[1]
        row_ids = pool_block_ids[:, None] * slot_num_layers + self.rows[None, :]
        return (row_ids[:, :, None] * cells_per_page + torch.arange(cells_per_page)).reshape(-1)


def _layer_cells(page: torch.Tensor, storage_ptr: int, cell_nbytes: int) -> torch.Tensor:
    """Block 0's page of one layer as cell ids: `[cells per page]`."""
    dims, span_nbytes = _spans(page)
    offsets = torch.tensor([page.data_ptr() - storage_ptr], dtype=torch.int64)
    for size, stride in dims:
        offsets = (offsets[:, None] + torch.arange(size, dtype=torch.int64) * stride).reshape(-1)
    inner = torch.arange(0, span_nbytes, cell_nbytes, dtype=torch.int64)
    return (offsets[:, None] + inner).reshape(-1) // cell_nbytes


def _cells_of_storage(rows: list[int], pages: list[torch.Tensor], num_engine_blocks: int) -> PageCells:
    """PageCells of layers `rows` whose `pages` ([num_engine_blocks, *page dims] uint8) share one allocation."""
    storage = _storage_bytes(pages[0])
    storage_ptr = storage.data_ptr()
    cell_nbytes = 0
    for page in pages:
        dims, span_nbytes = _spans(page[0])
        cell_nbytes = math.gcd(cell_nbytes, page.data_ptr() - storage_ptr, page.stride(0), span_nbytes,
                               *(stride for _, stride in dims))
    if cell_nbytes < MIN_CELL_NBYTES:
        raise UnsupportedModel(f"KV pages whose offsets and strides share only {cell_nbytes}-byte alignment "
                               f"(under {MIN_CELL_NBYTES}) cannot be moved as cells")
    first_cells = torch.stack([_layer_cells(page[0], storage_ptr, cell_nbytes) for page in pages])
    block_stride_cells = torch.tensor([page.stride(0) // cell_nbytes for page in pages], dtype=torch.int64)
    last_cell = first_cells.amax(dim=1) + (num_engine_blocks - 1) * block_stride_cells
    assert int(last_cell.max()) < storage.numel() // cell_nbytes, "a page beyond its allocation"
    return PageCells(storage, torch.tensor(rows, dtype=torch.int64), first_cells, block_stride_cells, cell_nbytes)


def group_cells(pages: Sequence[torch.Tensor], num_engine_blocks: int) -> list[PageCells]:
    """A group's layers (`pages[j]`: layer j's `[num_engine_blocks, *page dims]` uint8 view) as
    PageCells, one per allocation they live in, in order of their first layer."""
    by_storage: dict[int, list[int]] = {}
    for row, page in enumerate(pages):
        by_storage.setdefault(page.untyped_storage().data_ptr(), []).append(row)
    return [_cells_of_storage(rows, [pages[row] for row in rows], num_engine_blocks)
            for rows in by_storage.values()]
