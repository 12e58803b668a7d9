"""The copy engine on CUDA: one stream per direction, events, a completion thread per stream.

Device→host copies (offloads) run on a low-priority stream so they never hold up host→device
copies (loads a request is waiting for). Before a job is enqueued its stream waits for the
caller's current stream, so a copy sees everything the caller's kernels wrote. Host→host work
(the SSD tier filling host slots) is not a CUDA operation: it runs on threads, as without CUDA.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading

import torch

from kvtierd.movers.copy_engine import CopyEngine, Direction, Job, Transfer, run_on_pool

PCIE_BYTES_PER_S = 20e9  # a first guess until measured (PCIe 4.0 x16 is ~25 GB/s per direction)


class CudaCopyEngine(CopyEngine):
    """Invariant: transfers of one direction complete in submission order (one stream each)."""

    def __init__(self, device: str = "cuda:0", max_inflight_bytes: int = 1 << 30, num_host_threads: int = 2) -> None:
        super().__init__(max_inflight_bytes, {Direction.DEVICE_TO_HOST: PCIE_BYTES_PER_S,
                                              Direction.HOST_TO_DEVICE: PCIE_BYTES_PER_S,
                                              Direction.HOST_TO_HOST: 5e9})
        self.device = torch.device(device)
        # larger number = lower priority; torch's stub types this static method of _CudaStreamBase as an instance's
        least, greatest = torch.cuda.Stream.priority_range()  # pyright: ignore[reportCallIssue]
        self.streams = {
            Direction.DEVICE_TO_HOST: torch.cuda.Stream(self.device, priority=least),
            Direction.HOST_TO_DEVICE: torch.cuda.Stream(self.device, priority=greatest),
        }
        self._pending = {direction: queue.Queue() for direction in self.streams}
        self._threads = [threading.Thread(target=self._complete, args=(q,), daemon=True,
                                          name=f"kvtierd-copy-{d.value}") for d, q in self._pending.items()]
        for thread in self._threads:
            thread.start()
        self._host_pool = concurrent.futures.ThreadPoolExecutor(num_host_threads, thread_name_prefix="kvtierd-h2h")

    def _start(self, transfer: Transfer, job: Job) -> None:
        if transfer.direction is Direction.HOST_TO_HOST:
            run_on_pool(self._host_pool, transfer, job, self.bandwidth[transfer.direction])
            return
        stream = self.streams[transfer.direction]
        stream.wait_stream(torch.cuda.current_stream(self.device))
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            start.record(stream)
            job()
            end.record(stream)
        self._pending[transfer.direction].put((transfer, start, end))

    def _complete(self, pending: queue.Queue) -> None:
        while True:
            item = pending.get()
            if item is None:
                return
            transfer, start, end = item
            try:
                end.synchronize()
                seconds = start.elapsed_time(end) / 1000
            except BaseException as e:  # a failed copy is a failed transfer, never a hit
                transfer.future.set_exception(e)
                continue
            transfer.land(self.bandwidth[transfer.direction], seconds)

    def close(self) -> None:
        super().close()
        for q in self._pending.values():
            q.put(None)
        for thread in self._threads:
            thread.join()
        self._host_pool.shutdown(wait=True)
