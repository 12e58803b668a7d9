"""Page-locking the host tier: 8 GiB of HostSlab (mmap, parallel first touch, cudaHostRegister)
beside cudaHostAlloc of the same bytes. Needs CUDA and CuPy (the GPU acceptance run).

Ours: `HostSlab(num_slots, 2 MiB, pin=True)` as the host tier builds it (a /dev/shm segment,
first touched by its 4 threads, then cudaHostRegister), and the same with one touch thread per
CPU, as a context row. Baseline, same run: `cudaHostAlloc` of the same bytes (CuPy's runtime
binding), the allocation the CUDA runtime offers for pinned memory. Each round builds both and
frees both untimed; both must end page-locked (cudaPointerGetAttributes says host memory).
Goal: ours at most the baseline's time (Dynamo measured ~0.9 s against ~2.8 s for 8 GiB).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import _report  # noqa: E402
from kvtierd.t0.shm_segment import SHM_DIR  # noqa: E402
from kvtierd.t1.host_slab import HostSlab  # noqa: E402

SLOT_NBYTES = 2 << 20
GOAL_SPEEDUP = 1.0


class Pinned:
    """What the last round allocated, freed untimed before the next one (the round's setup)."""

    def __init__(self, runtime) -> None:
        self.runtime = runtime
        self.slab: HostSlab | None = None
        self.host_ptr = 0

    def free(self) -> None:
        if self.slab is not None:
            assert self.is_page_locked(self.slab.slots.data_ptr()), "the slab is not registered with CUDA"
            self.slab.close()
            self.slab = None
        if self.host_ptr:
            assert self.is_page_locked(self.host_ptr), "cudaHostAlloc gave pageable memory"
            self.runtime.freeHost(self.host_ptr)
            self.host_ptr = 0

    def is_page_locked(self, pointer: int) -> bool:
        return self.runtime.pointerGetAttributes(pointer).type == self.runtime.memoryTypeHost


def check_shm_room(nbytes: int) -> None:
    free = os.statvfs(SHM_DIR)
    if free.f_bavail * free.f_frsize < nbytes:
        raise SystemExit(f"bench_host_pinning: {SHM_DIR} has {free.f_bavail * free.f_frsize >> 20} MiB free, "
                         f"the slab needs {nbytes >> 20} MiB")


def main(argv: Sequence[str] | None = None) -> int:
    args = _report.parse_args(__doc__.splitlines()[0], argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_host_pinning: needs CUDA (torch.cuda.is_available() is false)")
    import cupy

    nbytes = (1 if args.quick else 8) << 30
    rounds, warmup = (2, 0) if args.quick else (3, 1)
    check_shm_room(nbytes)
    torch.cuda.init()
    pinned = Pinned(cupy.cuda.runtime)
    num_slots = nbytes // SLOT_NBYTES

    def cuda_host_alloc() -> None:
        pinned.host_ptr = pinned.runtime.hostAlloc(nbytes, pinned.runtime.hostAllocDefault)

    _report.print_header(f"Page-locked host memory: {nbytes >> 30} GiB ({num_slots} slots of 2 MiB)", args.quick)
    print("baseline: cudaHostAlloc of the same bytes (CuPy), in the same run; rounds free both untimed")
    print(f"goal: ours at most the baseline's time (speedup >= {GOAL_SPEEDUP:g}x)")
    print()
    rows = []
    for name, num_threads in (("HostSlab, 4 touch threads (the host tier)", 4),
                              (f"HostSlab, {os.cpu_count()} touch threads", os.cpu_count())):
        def host_slab(num_threads: int = num_threads) -> None:
            pinned.slab = HostSlab(num_slots, SLOT_NBYTES, pin=True, num_touch_threads=num_threads)

        ours, base = _report.time_pair(host_slab, cuda_host_alloc, rounds=rounds, warmup=warmup,
                                       ours_setup=pinned.free)
        speedup = base.median_ns / ours.median_ns
        goal = f">= {GOAL_SPEEDUP:g}x" if num_threads == 4 else "-"
        rows.append([name, _report.median_and_best(ours.median_ns / 1e9, ours.best_ns / 1e9, 2),
                     _report.median_and_best(base.median_ns / 1e9, base.best_ns / 1e9, 2), f"{speedup:.2f}x",
                     goal, _report.verdict(speedup >= GOAL_SPEEDUP) if num_threads == 4 else ""])
    _report.print_table(["pinning", "ours s", "cudaHostAlloc s", "speedup", "goal", "result"], rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
