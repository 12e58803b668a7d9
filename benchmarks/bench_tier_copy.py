"""T0 ↔ T1: copy 64 blocks of 2 MiB (Llama-3-8B, fp16) through the copy engine, beside memcpy.

Ours: `RawCodec.encode` (T0 → T1, offload) and `.decode` (T1 → T0, load) of 64 blocks as one
copy-engine job, exactly as the tier manager moves them. T0 is the device pool (a /dev/shm pool
without CUDA, GPU memory with it) and T1 the host slab (pinned with CUDA).
Baseline: a plain memcpy of the same bytes between the same two buffers, in one call: libc
memcpy (ctypes.memmove) without CUDA; with CUDA, one cudaMemcpyAsync (CuPy's runtime binding) of
the whole span on a stream of its own, then a synchronize of that stream.
Goal: ours >= 0.8x the baseline's bytes per second; with CUDA ours >= 0.9x and >= 45 GB/s in each
direction (an H200 on PCIe Gen5 x16 moves ~55 GB/s per direction).
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import _report  # noqa: E402
from kvtierd.layout import llama3_8b  # noqa: E402
from kvtierd.movers.copy_engine import Direction  # noqa: E402
from kvtierd.movers.factory import create_copy_engine  # noqa: E402
from kvtierd.t0.factory import create_device_pool  # noqa: E402
from kvtierd.t1.host_tier import HostTier  # noqa: E402

NUM_BLOCKS = 64
GOAL_RATIO = 0.8
CUDA_GOAL_RATIO = 0.9
CUDA_GOAL_GB_PER_S = 45.0


def memcpy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """One plain copy of all bytes with libc memcpy."""
    ctypes.memmove(dst.data_ptr(), src.data_ptr(), src.numel() * src.element_size())


class CudaMemcpy:
    """One cudaMemcpyAsync of all bytes (cudaMemcpyDefault: the pointers say the direction) on a
    stream of its own, then a synchronize of that stream: the bare runtime call, no torch."""

    def __init__(self) -> None:
        import cupy

        self.runtime = cupy.cuda.runtime
        self.stream = cupy.cuda.Stream(non_blocking=True)

    def __call__(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.runtime.memcpyAsync(dst.data_ptr(), src.data_ptr(), src.numel() * src.element_size(),
                                 self.runtime.memcpyDefault, self.stream.ptr)
        self.stream.synchronize()


def main(argv: Sequence[str] | None = None) -> int:
    args = _report.parse_args(__doc__.splitlines()[0], argv)
    rounds, warmup = (5, 1) if args.quick else (40, 5)
    num_blocks = 8 if args.quick else NUM_BLOCKS
    layout = llama3_8b()
    pool = create_device_pool(layout, num_blocks)
    host = HostTier(layout, num_blocks * layout.bytes_per_block)
    engine = create_copy_engine(str(pool.device))
    try:
        pool.tensor.copy_(torch.randn(pool.tensor.shape, dtype=torch.float32).to(layout.torch_dtype))
        ids = list(range(num_blocks))
        nbytes = num_blocks * layout.bytes_per_block
        assert host.slots.is_contiguous() and host.slab.stride == layout.bytes_per_block
        pool_bytes = pool.tensor.view(-1).view(torch.uint8)
        host_bytes = host.slots.reshape(-1)

        def offload() -> None:
            engine.run(Direction.DEVICE_TO_HOST, lambda: host.codec.encode(pool.tensor, ids, host.slots, ids), nbytes)

        def load() -> None:
            engine.run(Direction.HOST_TO_DEVICE, lambda: host.codec.decode(host.slots, ids, pool.tensor, ids), nbytes)

        offload()
        assert torch.equal(host_bytes, pool_bytes.cpu()), "offload must copy every byte"
        on_cuda = pool.device.type == "cuda"
        copy = CudaMemcpy() if on_cuda else memcpy
        goal_ratio, goal_gb_per_s = (CUDA_GOAL_RATIO, CUDA_GOAL_GB_PER_S) if on_cuda else (GOAL_RATIO, 0.0)
        _report.print_header(f"T0 <-> T1 copy: {num_blocks} blocks x {layout.bytes_per_block >> 20} MiB "
                             f"({nbytes >> 20} MiB), T0 on {pool.device}, T1 pinned={host.slab.pinned}", args.quick)
        print("baseline: one plain memcpy of the same bytes between the same buffers "
              f"({'cudaMemcpyAsync on a stream, then its synchronize' if on_cuda else 'ctypes.memmove'})")
        print(f"goal: ours >= {goal_ratio:g}x baseline (GB/s)" + (f" and >= {goal_gb_per_s:g} GB/s" if on_cuda else ""))
        print()
        rows = []
        for name, ours, baseline in [
            ("T0 -> T1 (offload, d2h)", offload, lambda: copy(host_bytes, pool_bytes)),
            ("T1 -> T0 (load, h2d)", load, lambda: copy(pool_bytes, host_bytes)),
        ]:
            ours_t, base_t = _report.time_pair(ours, baseline, rounds=rounds, warmup=warmup)
            ratio = base_t.median_ns / ours_t.median_ns
            ours_gb_per_s = nbytes / ours_t.median_ns
            goal = f">= {goal_ratio:g}x" + (f", >= {goal_gb_per_s:g} GB/s" if on_cuda else "")
            rows.append([name, f"{ours_gb_per_s:.2f}", f"{nbytes / base_t.median_ns:.2f}", f"{ratio:.2f}x", goal,
                         _report.verdict(ratio >= goal_ratio and ours_gb_per_s >= goal_gb_per_s)])
        _report.print_table(["direction", "ours GB/s", "memcpy GB/s", "ratio", "goal", "result"], rows)
    finally:
        engine.close()
        host.close()
        pool.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
