"""Rows copied between two row tensors in one submission, whatever the ids: the copy engine's jobs
between T0 blocks and T1 slots (block_codec.py) are one call each, not one per run of ids.

A *row tensor* is uint8 `[num_rows, row_nbytes]` whose rows are each one contiguous span, `row
stride` bytes apart (the pool: stride = row bytes; T1's slots: the 4 KiB-aligned slot stride). A copy
of rows `src_ids[i]` onto rows `dst_ids[i]` is planned as spans — runs where both ids go up by one
on sides whose rows lie back to back are coalesced into one span — and submitted in one call:
- both on the host: one `copy_spans` of the C extension `kvtierd._copy_spans` (kernels/copy_spans.c,
  built at install: a memcpy per span with the GIL released), a job of 8 MiB or more cut into equal
  shares copied on torch's number of threads at once (as torch's own copy_ splits one); where the
  extension was not built, a Python loop of memmoves (the same bytes, a Python step per span);
- a side on a CUDA device: one `cuMemcpyBatchAsync` on the current stream (cuda_batch_copy.py; the
  driver's per-call cost, ~2-3 µs, is paid once per job instead of once per run); where the driver
  lacks it or refuses a batch, one `copy_` per span on the current stream, said once in the log.
vLLM's SimpleCPUOffloadConnector (vllm/v1/simple_kv_offload) and llm-d's KV offload made the same
move from per-block copies to one batched submission.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import dataclasses
import logging
import os
import threading
from collections.abc import Sequence

import numpy as np
import torch

from kvtierd.movers import cuda_batch_copy, pinned_regions

log = logging.getLogger(__name__)

# Row ids: ints, or a 1-D integer array (np.asarray takes either).
RowIds = Sequence[int] | np.ndarray


def _load_native():  # noqa: ANN202 - the extension's module, or None
    try:
        from kvtierd import _copy_spans  # type: ignore[attr-defined]
    except ImportError:
        return None
    return _copy_spans


_NATIVE = _load_native()


def native_available() -> bool:
    """Was the C extension built (one call per host job), or does the Python loop run?"""
    return _NATIVE is not None


@dataclasses.dataclass(frozen=True, slots=True)
class SpanPlan:
    """The spans of one row copy: span k is `num_rows[k]` rows from src row `src_rows[k]` onto dst
    row `dst_rows[k]`, `sizes[k]` bytes at the byte addresses `dst_addresses[k]` / `src_addresses[k]`.
    Invariant: spans do not overlap on the dst side (ids are distinct), each lies inside its tensor."""

    dst_rows: np.ndarray  # int64
    src_rows: np.ndarray
    num_rows: np.ndarray
    dst_addresses: np.ndarray  # uint64
    src_addresses: np.ndarray
    sizes: np.ndarray  # uint64, bytes

    @property
    def num_spans(self) -> int:
        return len(self.sizes)


def _row_stride(rows: torch.Tensor) -> int:
    """Bytes between row starts of a row tensor (uint8 `[n, row_nbytes]`, each row contiguous)."""
    assert rows.dtype == torch.uint8 and rows.dim() == 2 and (rows.shape[1] <= 1 or rows.stride(1) == 1), \
        f"a row tensor is uint8 [rows, bytes] with contiguous rows: {rows.dtype} {tuple(rows.shape)} {rows.stride()}"
    return rows.stride(0)


def plan_spans(dst: torch.Tensor, dst_ids: RowIds, src: torch.Tensor, src_ids: RowIds) -> SpanPlan:
    """The spans copying rows `src_ids[i]` of `src` onto rows `dst_ids[i]` of `dst`, adjacent runs coalesced."""
    assert len(dst_ids) == len(src_ids), (len(dst_ids), len(src_ids))
    assert dst.shape[1] == src.shape[1], f"rows of {dst.shape[1]} and {src.shape[1]} bytes"
    row_nbytes = dst.shape[1]
    dst_stride, src_stride = _row_stride(dst), _row_stride(src)
    dst_index = np.asarray(dst_ids, dtype=np.int64)
    src_index = np.asarray(src_ids, dtype=np.int64)
    if len(dst_index):
        assert 0 <= dst_index.min() and dst_index.max() < dst.shape[0], "dst row id out of range"
        assert 0 <= src_index.min() and src_index.max() < src.shape[0], "src row id out of range"
    if dst_stride == row_nbytes and src_stride == row_nbytes and len(dst_index) > 1:
        breaks = np.flatnonzero((np.diff(dst_index) != 1) | (np.diff(src_index) != 1)) + 1
        starts = np.concatenate(([0], breaks))
        num_rows = np.diff(np.concatenate((starts, [len(dst_index)])))
        dst_rows, src_rows = dst_index[starts], src_index[starts]
    else:
        dst_rows, src_rows, num_rows = dst_index, src_index, np.ones(len(dst_index), dtype=np.int64)
    return SpanPlan(dst_rows, src_rows, num_rows,
                    (dst_rows * dst_stride + dst.data_ptr()).astype(np.uint64),
                    (src_rows * src_stride + src.data_ptr()).astype(np.uint64),
                    (num_rows * row_nbytes).astype(np.uint64))


def copy_rows(dst: torch.Tensor, dst_ids: RowIds, src: torch.Tensor, src_ids: RowIds) -> int:
    """dst[dst_ids[i]] = src[src_ids[i]] for row tensors (see the module doc), in one submission where
    the platform allows; on CUDA, enqueued on the current stream. Returns the number of spans."""
    if not len(dst_ids):
        return 0
    plan = plan_spans(dst, dst_ids, src, src_ids)
    if dst.device.type == "cpu" and src.device.type == "cpu":
        _copy_on_host(plan)
    else:
        _copy_with_cuda(plan, dst, src)
    return plan.num_spans


PARALLEL_FROM_BYTES = 8 << 20  # a host job this large is cut into equal shares, one per thread
_pool: concurrent.futures.ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _share_pool(num_threads: int) -> concurrent.futures.ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(num_threads, thread_name_prefix="kvtierd-memcpy")
        return _pool


def cut_shares(dst_addresses: np.ndarray, src_addresses: np.ndarray, sizes: np.ndarray,
               num_shares: int) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """The spans cut into `num_shares` runs of equal bytes (a span split where a share ends), in order."""
    sizes64 = sizes.astype(np.int64)
    ends = np.cumsum(sizes64)
    starts = ends - sizes64
    total = int(ends[-1]) if len(ends) else 0
    shares = []
    for i in range(num_shares):
        low, high = total * i // num_shares, total * (i + 1) // num_shares
        first, last = np.searchsorted(ends, low, side="right"), np.searchsorted(starts, high, side="left")
        cut_low, cut_high = np.maximum(starts[first:last], low), np.minimum(ends[first:last], high)
        offsets = (cut_low - starts[first:last]).astype(np.uint64)
        shares.append((dst_addresses[first:last] + offsets, src_addresses[first:last] + offsets,
                       (cut_high - cut_low).astype(np.uint64)))
    return shares


def _copy_on_host(plan: SpanPlan) -> None:
    if _NATIVE is not None:
        num_threads = min(torch.get_num_threads(), os.cpu_count() or 1, 8)
        if num_threads > 1 and int(plan.sizes.sum()) >= PARALLEL_FROM_BYTES:  # as torch's copy_ splits one
            pool = _share_pool(num_threads - 1)  # the calling thread copies a share too
            shares = cut_shares(plan.dst_addresses, plan.src_addresses, plan.sizes, num_threads)
            others = [pool.submit(_NATIVE.copy_spans, *share) for share in shares[1:]]
            try:
                _NATIVE.copy_spans(*shares[0])  # this thread's share: it would only wait otherwise
            finally:
                concurrent.futures.wait(others)
            for done in others:
                done.result()
        else:
            _NATIVE.copy_spans(plan.dst_addresses, plan.src_addresses, plan.sizes)
        return
    for dst_address, src_address, nbytes in zip(plan.dst_addresses.tolist(), plan.src_addresses.tolist(),
                                                plan.sizes.tolist()):
        ctypes.memmove(dst_address, src_address, nbytes)


def _copy_with_cuda(plan: SpanPlan, dst: torch.Tensor, src: torch.Tensor) -> None:
    device = dst.device if dst.device.type == "cuda" else src.device
    stream = torch.cuda.current_stream(device).cuda_stream
    dst_addresses, src_addresses, sizes = plan.dst_addresses, plan.src_addresses, plan.sizes
    if dst.device.type == "cpu":  # no span across two of the host's registrations (pinned_regions.py)
        dst_addresses, src_addresses, sizes = pinned_regions.split_spans(dst_addresses, src_addresses, sizes)
    elif src.device.type == "cpu":
        src_addresses, dst_addresses, sizes = pinned_regions.split_spans(src_addresses, dst_addresses, sizes)
    if cuda_batch_copy.submit(dst_addresses, src_addresses, sizes, stream):
        return
    for dst_row, src_row, num_rows in zip(plan.dst_rows.tolist(), plan.src_rows.tolist(), plan.num_rows.tolist()):
        dst[dst_row:dst_row + num_rows].copy_(src[src_row:src_row + num_rows], non_blocking=True)
