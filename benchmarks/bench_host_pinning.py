"""Page-locking the host tier: a 64 GiB HostSlab pinned grain by grain (1 GiB registrations on slot
boundaries, each first touched by threads on the GPU's NUMA node, then cudaHostRegister), beside
cudaHostAlloc of the same bytes. Needs CUDA and CuPy (the GPU acceptance run).

Ours: `HostSlab(num_slots, 2 MiB, pin=True)` as the host tier builds it (a sparse /dev/shm segment),
then `extend_to` its end, as a layout's T1 takes its share: the seconds until T1 can serve its first
grain, the seconds until all of it is page-locked, and the seconds per GiB. Baseline, same run:
`cudaHostAlloc` of the same bytes (CuPy's runtime binding), the allocation the CUDA runtime offers
for pinned memory, timed whole. One round each (64 GiB is most of the machine's memory; the slab is
freed before the baseline allocates), both checked page-locked (cudaPointerGetAttributes says host
memory). The size is 64 GiB or less where /dev/shm or the machine's memory cannot hold it (printed).
Goal: ours at most the baseline's seconds per GiB (the H200 machine: 8 GiB in 2.5 s by this route,
cudaHostAlloc 4.7 s), and T1 serving within 5 % of the baseline's time.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import _report  # noqa: E402
from kvtierd.t0.shm_segment import SHM_DIR  # noqa: E402
from kvtierd.t1.host_slab import HostSlab  # noqa: E402
from kvtierd.units import GiB  # noqa: E402

SLOT_NBYTES = 2 << 20
TARGET_BYTES, QUICK_BYTES = 64 * GiB, 2 * GiB
GOAL_SPEEDUP = 1.0  # baseline s/GiB over ours
GOAL_FIRST_SERVE = 0.05  # T1 serving after at most this fraction of the baseline's time


def slab_bytes(target: int) -> int:
    """`target`, or less where /dev/shm or 45 % of the machine's memory cannot hold it, in whole GiB."""
    shm = os.statvfs(SHM_DIR)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    room = min(target, int(shm.f_bavail * shm.f_frsize * 0.9), int(memory * 0.45))
    if room < GiB:
        raise SystemExit(f"bench_host_pinning: {SHM_DIR} or memory has room for {room >> 20} MiB, need >= 1 GiB")
    return room // GiB * GiB


def main(argv: Sequence[str] | None = None) -> int:
    args = _report.parse_args(__doc__.splitlines()[0], argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_host_pinning: needs CUDA (torch.cuda.is_available() is false)")
    import cupy

    runtime = cupy.cuda.runtime
    nbytes = slab_bytes(QUICK_BYTES if args.quick else TARGET_BYTES)
    num_slots = nbytes // SLOT_NBYTES
    torch.cuda.init()

    def page_locked(pointer: int) -> bool:
        return runtime.pointerGetAttributes(pointer).type == runtime.memoryTypeHost

    _report.print_header(f"Page-locked host memory: {nbytes / GiB:.0f} GiB ({num_slots} slots of 2 MiB)", args.quick,
                         "timing: time.perf_counter around one build each, ours first, the slab freed before the "
                         "baseline allocates")
    print("baseline: cudaHostAlloc of the same bytes (CuPy), in the same run")
    print(f"goal: ours at most the baseline's s/GiB (speedup >= {GOAL_SPEEDUP:g}x); T1 serving within "
          f"{GOAL_FIRST_SERVE:.0%} of the baseline's time")
    print()
    first_ready_s: list[float] = []

    def on_ready(num_ready_slots: int) -> None:  # the first call: T1 could serve from here on
        if not first_ready_s:
            first_ready_s.append(time.perf_counter() - started)

    started = time.perf_counter()
    slab = HostSlab(num_slots, SLOT_NBYTES, pin=True, what="bench slab")
    slab.extend_to(num_slots, on_ready)
    ours_s = time.perf_counter() - started
    assert slab.num_ready_slots == num_slots and page_locked(slab.slots.data_ptr() + nbytes - SLOT_NBYTES)
    num_registrations = -(-num_slots // slab.grain_slots)
    slab.close()

    started = time.perf_counter()
    pointer = runtime.hostAlloc(nbytes, runtime.hostAllocDefault)
    base_s = time.perf_counter() - started
    assert page_locked(pointer), "cudaHostAlloc gave pageable memory"
    runtime.freeHost(pointer)

    gib = nbytes / GiB
    speedup = base_s / ours_s
    first = first_ready_s[0] if first_ready_s else ours_s
    rows = [[f"all pinned ({num_registrations} registrations)", f"{ours_s:.2f}", f"{ours_s / gib:.3f}",
             f"{base_s:.2f}", f"{base_s / gib:.3f}", f"{speedup:.2f}x", f">= {GOAL_SPEEDUP:g}x",
             _report.verdict(speedup >= GOAL_SPEEDUP)],
            ["T1 serving (first grain pinned)", f"{first:.2f}", "-", f"{base_s:.2f}", "-", f"{first / base_s:.3f}x",
             f"<= {GOAL_FIRST_SERVE:g}x", _report.verdict(first <= GOAL_FIRST_SERVE * base_s)]]
    _report.print_table(["pinning", "ours s", "ours s/GiB", "cudaHostAlloc s", "cudaHostAlloc s/GiB", "ratio", "goal",
                         "result"], rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
