"""SGLang's host KV pool seen as pages in kvtierd's block order.

SGLang's HiCache keeps a host pool (L2) of `size` token slots, `page_size` to a page, in one of
several memory layouts (sglang 0.5.23, mem_cache/pool_host/mha.py and mla.py, `init_kv_buffer`):

    MHA  layer_first        (2, layers, size, heads, head_dim)
         page_first         (2, size, layers, heads, head_dim)
         page_first_direct  (2, pages, layers, page_size, heads, head_dim)
         page_head          (2, pages, heads, page_size, layers, head_dim)
    MLA  layer_first        (layers, size, 1, kv_dim)
         page_first         (size, layers, 1, kv_dim)
         page_first_direct  (pages, layers, page_size, 1, kv_dim)

`HostPages.view` is a strided view of the pool's one buffer, indexed by page, each page in the
order of a kvtierd block: `[layers, 2, page_size, heads, head_dim]` (MHA: K and V of one float
dtype, the daemon's own block order, so a page stored from one host layout loads into another) or
`[layers, page_size, kv_dim]` (MLA: the latents as they are, an opaque uint8 block to the daemon).
Copies gather and scatter whole pages through it; no SGLang import here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

# Per host layout: (the page-split view of the buffer's first page axis, the permutation that makes
# it page-major in block order). "split" cuts the token axis at `split_axis` into (pages, page_size).
_MHA_ORDER: dict[str, tuple[int | None, tuple[int, ...]]] = {
    # (2, L, S, H, D) -> (2, L, NP, P, H, D) -> (NP, L, 2, P, H, D)
    "layer_first": (2, (2, 1, 0, 3, 4, 5)),
    # (2, S, L, H, D) -> (2, NP, P, L, H, D) -> (NP, L, 2, P, H, D)
    "page_first": (1, (1, 3, 0, 2, 4, 5)),
    # (2, NP, L, P, H, D) -> (NP, L, 2, P, H, D)
    "page_first_direct": (None, (1, 2, 0, 3, 4, 5)),
    # (2, NP, H, P, L, D) -> (NP, L, 2, P, H, D)
    "page_head": (None, (1, 4, 0, 3, 2, 5)),
}
_MLA_ORDER: dict[str, tuple[int | None, tuple[int, ...]]] = {
    # (L, S, 1, K) -> (L, NP, P, 1, K) -> (NP, L, P, 1, K)
    "layer_first": (1, (1, 0, 2, 3, 4)),
    # (S, L, 1, K) -> (NP, P, L, 1, K) -> (NP, L, P, 1, K)
    "page_first": (0, (0, 2, 1, 3, 4)),
    # (NP, L, P, 1, K): already page-major
    "page_first_direct": (None, (0, 1, 2, 3, 4)),
}
HOST_LAYOUTS = {"mha": tuple(_MHA_ORDER), "mla": tuple(_MLA_ORDER)}


class UnsupportedHostPool(ValueError):
    """A host pool whose memory layout or kind this connector cannot address (said in one line)."""


@dataclasses.dataclass(frozen=True)
class HostPages:
    """The host pool's pages in block order.

    Invariants: `view[p]` aliases page `p` of the pool's buffer (no copy); `view.shape[1:]` is one
    block's shape; a page's first token slot is `p * page_size`.
    """

    view: torch.Tensor
    page_size: int
    kind: str  # "mha" or "mla"

    @classmethod
    def of_buffer(cls, buffer: torch.Tensor, kind: str, host_layout: str, page_size: int) -> HostPages:
        orders = {"mha": _MHA_ORDER, "mla": _MLA_ORDER}.get(kind)
        if orders is None:
            raise UnsupportedHostPool(f"host pool kind {kind!r} is not one of mha, mla")
        if host_layout not in orders:
            raise UnsupportedHostPool(f"the {kind} host layout {host_layout!r} is not supported "
                                      f"(use one of {', '.join(orders)})")
        split_axis, order = orders[host_layout]
        view = buffer
        if split_axis is not None:
            shape = list(buffer.shape)
            if shape[split_axis] % page_size:
                raise UnsupportedHostPool(f"a host pool of {shape[split_axis]} token slots is not whole pages of "
                                          f"{page_size}")
            shape[split_axis:split_axis + 1] = [shape[split_axis] // page_size, page_size]
            view = buffer.view(shape)
        return cls(view.permute(order), page_size, kind)

    @property
    def num_pages(self) -> int:
        return self.view.shape[0]

    @property
    def block_shape(self) -> tuple[int, ...]:
        return tuple(self.view.shape[1:])

    @property
    def page_nbytes(self) -> int:
        return self.view[0].numel() * self.view.element_size()

    def page_ids(self, host_indices: torch.Tensor) -> list[int]:
        """The pages of SGLang's host token indices (page_size per page, each page's first slot first)."""
        if host_indices.numel() % self.page_size:
            raise ValueError(f"{host_indices.numel()} host indices are not whole pages of {self.page_size}")
        firsts = host_indices.reshape(-1, self.page_size)[:, 0].to(torch.int64)
        if bool((firsts % self.page_size).any()):
            raise ValueError("a host page does not start on a page boundary")
        return (firsts // self.page_size).tolist()

    def copy_out(self, page_ids: list[int], blocks: Sequence[torch.Tensor]) -> None:
        """Copy the pages into `blocks` (rows of one block's bytes each, any device): one strided copy a
        page, no gathered tensor in between."""
        for row, page_id in zip(blocks, page_ids):
            row.view(self.view.dtype).view(self.block_shape).copy_(self.view[page_id], non_blocking=True)

    def copy_in(self, page_ids: list[int], blocks: Sequence[torch.Tensor]) -> None:
        """Copy `blocks` (rows of one block's bytes each, any device) into the pages, one copy a page."""
        for row, page_id in zip(blocks, page_ids):
            self.view[page_id].copy_(row.view(self.view.dtype).view(self.block_shape))

    def read(self, page_ids: list[int]) -> torch.Tensor:
        """The pages, gathered into one contiguous tensor `[len(page_ids), *block_shape]`."""
        return self.view[torch.as_tensor(page_ids, dtype=torch.int64)]

    def write(self, page_ids: list[int], blocks: torch.Tensor) -> None:
        """Scatter `blocks` (`[len(page_ids), *block_shape]`, any dtype of the same bytes) into the pages."""
        self.view[torch.as_tensor(page_ids, dtype=torch.int64)] = blocks.view(self.view.dtype).reshape(
            len(page_ids), *self.block_shape)
