"""The copy engine: real copies on threads, bounded in-flight bytes, errors, bandwidth."""

from __future__ import annotations

import threading

import pytest
import torch

from kvtierd.errors import InvalidArgument
from kvtierd.launch.daemon_process import wait_until
from kvtierd.movers.copy_engine import Bandwidth, Direction, ThreadCopyEngine


@pytest.fixture
def engine():
    engine = ThreadCopyEngine(num_threads=2, max_inflight_bytes=1000)
    yield engine
    engine.close()


def test_a_job_copies_and_its_bandwidth_is_measured(engine):
    src, dst = torch.arange(1 << 20, dtype=torch.float32), torch.zeros(1 << 20)
    engine.submit(Direction.HOST_TO_HOST, lambda: dst.copy_(src), 500).wait(10)
    assert torch.equal(src, dst)
    assert engine.bandwidth[Direction.HOST_TO_HOST].num_samples == 1 and engine.inflight_bytes == 0


def test_a_failing_job_fails_its_transfer_and_frees_the_budget(engine):
    def boom():
        raise OSError("bad copy")

    transfer = engine.submit(Direction.DEVICE_TO_HOST, boom, 800)
    with pytest.raises(OSError):
        transfer.wait(10)
    assert engine.inflight_bytes == 0


def test_submit_blocks_while_the_budget_is_spent(engine):
    release = threading.Event()
    first = engine.submit(Direction.HOST_TO_HOST, release.wait, 800)
    second_started = threading.Event()

    def submit_second():
        engine.submit(Direction.HOST_TO_HOST, lambda: None, 800).wait(10)
        second_started.set()

    thread = threading.Thread(target=submit_second)
    thread.start()
    assert wait_until(lambda: engine.num_waiting_submits == 1)  # the second submit waits on the budget
    assert not second_started.is_set() and engine.inflight_bytes == 800  # held back: 1600 > 1000
    release.set()
    first.wait(10)
    thread.join(10)
    assert second_started.is_set() and engine.inflight_bytes == 0


def test_a_transfer_larger_than_the_budget_runs_alone(engine):
    """A 5000-byte transfer against a 1000-byte budget starts on an idle engine, not never."""
    seen_inflight = []
    engine.submit(Direction.HOST_TO_HOST, lambda: seen_inflight.append(engine.inflight_bytes), 5000).wait(10)
    assert seen_inflight == [5000] and engine.num_waiting_submits == 0
    assert engine.wait_idle(10) and engine.inflight_bytes == 0


def test_bandwidth_is_the_median_of_the_recent_copies():
    bandwidth = Bandwidth(1e9)
    assert bandwidth.bytes_per_s == 1e9 and bandwidth.num_samples == 0  # the first guess
    bandwidth.record(100, 1.0)
    assert bandwidth.bytes_per_s == 100  # the first sample replaces the guess
    bandwidth.record(300, 1.0)
    bandwidth.record(1, 1.0)  # a stalled copy does not move the median of three
    assert bandwidth.bytes_per_s == 100 and bandwidth.seconds_for(400) == 4.0
    for _ in range(Bandwidth.RECENT_SAMPLES):  # only the recent copies count
        bandwidth.record(1000, 1.0)
    assert bandwidth.bytes_per_s == 1000 and bandwidth.num_samples == 3 + Bandwidth.RECENT_SAMPLES
    assert bandwidth.total_bytes == 401 + 1000 * Bandwidth.RECENT_SAMPLES


def test_bad_budget_is_refused():
    with pytest.raises(InvalidArgument):
        ThreadCopyEngine(max_inflight_bytes=0)


@pytest.mark.gpu
def test_cuda_engine_copies_both_ways():
    from kvtierd.movers.cuda_copy_engine import CudaCopyEngine

    engine = CudaCopyEngine("cuda:0")
    try:
        device = torch.arange(1 << 20, dtype=torch.float16, device="cuda")
        host = torch.empty(1 << 20, dtype=torch.float16).pin_memory()
        engine.submit(Direction.DEVICE_TO_HOST, lambda: host.copy_(device, non_blocking=True), 2 << 20).wait(10)
        assert torch.equal(host, device.cpu())
        back = torch.zeros_like(device)
        engine.submit(Direction.HOST_TO_DEVICE, lambda: back.copy_(host, non_blocking=True), 2 << 20).wait(10)
        assert torch.equal(back, device)
        assert engine.bandwidth[Direction.DEVICE_TO_HOST].num_samples == 1
    finally:
        engine.close()
