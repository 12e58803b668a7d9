"""Row copies in one submission: spans coalesced where both ids run on, bytes exact whatever the
order, one C call per host job (the Python loop gives the same bytes)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvtierd.movers import span_copy
from kvtierd.movers.span_copy import copy_rows, plan_spans

ROW_NBYTES = 96


def byte_rows(num_rows: int, stride: int = ROW_NBYTES, fill: bool = True) -> torch.Tensor:
    slab = torch.zeros((num_rows, stride), dtype=torch.uint8)
    if fill:
        slab.copy_(torch.randint(0, 256, slab.shape, dtype=torch.uint8))
    return slab[:, :ROW_NBYTES]


def test_adjacent_runs_coalesce_into_one_span_each():
    dst, src = byte_rows(16), byte_rows(16)
    plan = plan_spans(dst, [3, 4, 5, 9, 10, 0], src, [7, 8, 9, 1, 2, 3])
    assert plan.num_rows.tolist() == [3, 2, 1]
    assert plan.dst_rows.tolist() == [3, 9, 0] and plan.src_rows.tolist() == [7, 1, 3]
    assert plan.sizes.tolist() == [3 * ROW_NBYTES, 2 * ROW_NBYTES, ROW_NBYTES]
    assert plan.dst_addresses.tolist() == [dst.data_ptr() + r * ROW_NBYTES for r in (3, 9, 0)]
    # a run on one side only is not a run: both ids must go up by one
    assert plan_spans(dst, [0, 1, 2], src, [0, 2, 4]).num_spans == 3


def test_rows_that_are_not_back_to_back_are_spans_of_one_row():
    slots = byte_rows(8, stride=ROW_NBYTES + 32)  # a slot stride above the slot's bytes, as T1's 4 KiB pages
    plan = plan_spans(slots, [0, 1, 2], byte_rows(8), [0, 1, 2])
    assert plan.num_rows.tolist() == [1, 1, 1]
    assert plan.dst_addresses.tolist() == [slots.data_ptr() + r * (ROW_NBYTES + 32) for r in range(3)]


@given(st.data())
def test_copy_rows_writes_exactly_the_named_rows(data):
    num_rows = data.draw(st.integers(1, 24))
    count = data.draw(st.integers(0, num_rows))
    dst_ids = data.draw(st.permutations(range(num_rows)))[:count]
    src_ids = data.draw(st.lists(st.integers(0, num_rows - 1), min_size=count, max_size=count))
    dst_stride = data.draw(st.sampled_from([ROW_NBYTES, ROW_NBYTES + 64]))
    src, dst = byte_rows(num_rows), byte_rows(num_rows, dst_stride, fill=False)
    expected = dst.clone()
    expected[dst_ids] = src[src_ids]
    copy_rows(dst, dst_ids, src, src_ids)
    assert torch.equal(dst, expected)
    if dst_stride != ROW_NBYTES:  # the padding between rows is never written
        assert not dst.as_strided((num_rows, dst_stride - ROW_NBYTES), (dst_stride, 1),
                                  dst.storage_offset() + ROW_NBYTES).any()


def test_a_shuffled_host_job_is_one_native_call(monkeypatch):
    assert span_copy.native_available(), "the C extension builds wherever a compiler is (setup.py)"
    calls = []
    native = span_copy._NATIVE
    monkeypatch.setattr(span_copy, "_NATIVE", type("Counting", (), {
        "copy_spans": staticmethod(lambda *args: calls.append(len(args[2])) or native.copy_spans(*args))}))
    ids = [i * 97 % 256 for i in range(256)]  # every block its own run, as in a pool after churn
    src, dst = byte_rows(256), byte_rows(256, fill=False)
    assert copy_rows(dst, ids, src, list(range(256))) == 256
    assert calls == [256]  # one call for 256 spans
    assert torch.equal(dst[ids], src)


def test_the_python_loop_copies_the_same_bytes(monkeypatch):
    monkeypatch.setattr(span_copy, "_NATIVE", None)
    src, dst = byte_rows(8), byte_rows(8, stride=ROW_NBYTES + 16, fill=False)
    copy_rows(dst, [7, 0, 1, 2], src, [0, 5, 6, 7])
    assert torch.equal(dst[[7, 0, 1, 2]], src[[0, 5, 6, 7]])


def test_the_native_call_refuses_mismatched_or_mistyped_arrays():
    native = span_copy._NATIVE
    assert native is not None
    addresses = np.zeros(2, dtype=np.uint64)
    with pytest.raises(ValueError, match="as many addresses as sizes"):
        native.copy_spans(addresses, addresses, np.zeros(3, dtype=np.uint64))
    with pytest.raises(TypeError, match="uint64"):
        native.copy_spans(np.zeros(2, dtype=np.int32), addresses, addresses)


def test_an_empty_copy_submits_nothing():
    assert copy_rows(byte_rows(2), [], byte_rows(2), []) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("direction", ["d2h", "h2d"])
def test_on_cuda_a_shuffled_job_is_one_batched_driver_call_and_bit_exact(direction, monkeypatch):
    """On a CUDA >= 12.8 driver the batch goes to cuMemcpyBatchAsync (not the per-span fallback),
    on the copy engine's stream, and lands every byte where the ids say."""
    from kvtierd.movers import cuda_batch_copy
    from kvtierd.movers.copy_engine import Direction
    from kvtierd.movers.cuda_copy_engine import CudaCopyEngine

    assert cuda_batch_copy._binding() is not None, "the GPU machine's driver has cuMemcpyBatchAsync"
    calls = []
    submit = cuda_batch_copy.submit
    monkeypatch.setattr(cuda_batch_copy, "submit", lambda *args: calls.append(len(args[2])) or submit(*args))
    num_rows, row_nbytes = 512, 64 << 10
    ids = [i * 97 % num_rows for i in range(num_rows)]
    device = torch.randint(0, 256, (num_rows, row_nbytes), dtype=torch.uint8, device="cuda")
    host = torch.zeros((num_rows, row_nbytes), dtype=torch.uint8).pin_memory()
    if direction == "h2d":
        host.copy_(device.cpu())
        device = torch.zeros_like(device)
    engine = CudaCopyEngine("cuda:0")
    try:
        if direction == "d2h":
            job = lambda: copy_rows(host, ids, device, list(range(num_rows)))  # noqa: E731
        else:
            job = lambda: copy_rows(device, list(range(num_rows)), host, ids)  # noqa: E731
        kind = Direction.DEVICE_TO_HOST if direction == "d2h" else Direction.HOST_TO_DEVICE
        engine.submit(kind, job, num_rows * row_nbytes).wait(30)
    finally:
        engine.close()
    assert calls == [num_rows]  # one batch of 512 spans, submitted once, not refused
    assert not cuda_batch_copy._STATE.disabled
    if direction == "d2h":
        assert torch.equal(host[ids], device.cpu())
    else:
        assert torch.equal(device.cpu(), host[ids])


@given(sizes=st.lists(st.integers(1, 5000), min_size=1, max_size=12), num_shares=st.integers(1, 5))
def test_shares_cover_every_byte_once_in_order(sizes, num_shares):
    """Cut into shares, the spans still name every byte once, dst and src advancing together."""
    from kvtierd.movers.span_copy import cut_shares

    sizes_array = np.asarray(sizes, dtype=np.uint64)
    starts = np.concatenate(([0], np.cumsum(sizes_array)[:-1])).astype(np.uint64)
    dst, src = starts + np.uint64(1 << 40), starts + np.uint64(1 << 41)
    shares = cut_shares(dst, src, sizes_array, num_shares)
    assert len(shares) == num_shares
    pieces = [(int(d), int(s), int(n)) for share in shares for d, s, n in zip(*share) if n]
    covered = [(d - (1 << 40), n) for d, _, n in pieces]
    assert all(s - d == (1 << 41) - (1 << 40) for d, s, _ in pieces)
    assert [b for start, n in covered for b in range(start, start + n)] == list(range(sum(sizes)))
    totals = [int(share[2].sum()) for share in shares]
    assert max(totals) - min(totals) <= 1


def test_a_large_host_job_in_shares_copies_the_same_bytes(monkeypatch):
    monkeypatch.setattr(span_copy, "PARALLEL_FROM_BYTES", 1)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    ids = [i * 97 % 256 for i in range(256)]
    src, dst = byte_rows(256), byte_rows(256, fill=False)
    copy_rows(dst, ids, src, list(range(256)))
    assert torch.equal(dst[ids], src)
