"""T0 ↔ T1: copy 64 blocks of 2 MiB (Llama-3-8B, fp16) through the copy engine, beside memcpy.

Ours: `RawCodec.encode` (T0 → T1, offload) and `.decode` (T1 → T0, load) of 64 blocks as one
copy-engine job, exactly as the tier manager moves them. T0 is the device pool (a /dev/shm pool
without CUDA, GPU memory with it) and T1 the host slab (pinned with CUDA).
Baseline: a plain memcpy of the same bytes between the same two buffers, in one call: libc
memcpy (ctypes.memmove) without CUDA; one torch copy (cudaMemcpy) of the whole span with CUDA.
Goal: ours >= 0.8x the baseline's bytes per second.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import _report  # noqa: E402
from kvtierd.copy_engine import Direction, create_copy_engine  # noqa: E402
from kvtierd.device_pool import create_device_pool  # noqa: E402
from kvtierd.host_tier import HostTier  # noqa: E402
from kvtierd.layout import llama3_8b  # noqa: E402

NUM_BLOCKS = 64
GOAL_RATIO = 0.8


def memcpy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """One plain copy of all bytes: libc memcpy on the host, cudaMemcpy when either is on CUDA."""
    if dst.is_cuda or src.is_cuda:
        dst.copy_(src)
        torch.cuda.synchronize()
    else:
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), src.numel() * src.element_size())


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
        _report.print_header(f"T0 <-> T1 copy: {num_blocks} blocks x {layout.bytes_per_block >> 20} MiB "
                             f"({nbytes >> 20} MiB), T0 on {pool.device}, T1 pinned={host.slab.pinned}", args.quick)
        print("baseline: one plain memcpy of the same bytes between the same buffers "
              "(ctypes.memmove on the host, cudaMemcpy with CUDA)")
        print(f"goal: ours >= {GOAL_RATIO:g}x baseline (GB/s)")
        print()
        rows = []
        for name, ours, baseline in [
            ("T0 -> T1 (offload, d2h)", offload, lambda: memcpy(host_bytes, pool_bytes)),
            ("T1 -> T0 (load, h2d)", load, lambda: memcpy(pool_bytes, host_bytes)),
        ]:
            ours_t, base_t = _report.time_pair(ours, baseline, rounds=rounds, warmup=warmup)
            ratio = base_t.median_ns / ours_t.median_ns
            rows.append([name, f"{nbytes / ours_t.median_ns:.2f}", f"{nbytes / base_t.median_ns:.2f}",
                         f"{ratio:.2f}x", f">= {GOAL_RATIO:g}x", _report.verdict(ratio >= GOAL_RATIO)])
        _report.print_table(["direction", "ours GB/s", "memcpy GB/s", "ratio", "goal", "result"], rows)
    finally:
        engine.close()
        host.close()
        pool.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
