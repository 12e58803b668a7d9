"""T0 <-> T1 through the copy engine, swept over block sizes, id orders and directions, beside memcpy.

Ours: `RawCodec.encode` (T0 -> T1, offload, d2h) and `.decode` (T1 -> T0, load, h2d) of a batch of
blocks as one copy-engine job each, exactly as the tier manager moves them: T0 is the device pool (a
/dev/shm pool without CUDA, GPU memory with it), T1 the host slab (page-locked with CUDA).
The sweep: blocks of 64 KiB (Llama-3-8B at TP 4, block 2), 256 KiB (Llama-3-8B, block 2) and
2 MiB (Llama-3-8B, block 16) x pool ids contiguous or shuffled (every block its own run, as in a
pool after churn) x each direction alone, or both at once (an offload and a load of other blocks
in flight together).
Baseline, same run: one plain copy of the same bytes between the same buffers: libc memcpy
(ctypes.memmove) without CUDA; with CUDA one cudaMemcpyAsync (CuPy's runtime binding) of the whole
span on a stream of its own, then its synchronize; for both directions at once, two such copies
on two threads (two streams).
Goals: on a GPU, ours >= 0.95x the baseline at 2 MiB, >= 0.9x at 256 KiB, >= 0.6x at 64 KiB,
contiguous and shuffled alike; without CUDA, contiguous >= 0.8x memcpy and shuffled >= 0.8x of
our own contiguous figure (a job is one call whatever the ids).
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import _report  # noqa: E402
from kvtierd.layout import Layout, llama3_8b  # noqa: E402
from kvtierd.movers.copy_engine import CopyEngine, Direction  # noqa: E402
from kvtierd.movers.factory import create_copy_engine  # noqa: E402
from kvtierd.movers.span_copy import native_available  # noqa: E402
from kvtierd.t0.device_pool import DevicePool  # noqa: E402
from kvtierd.t0.factory import create_device_pool  # noqa: E402
from kvtierd.t1.host_tier import HostTier  # noqa: E402

LAYOUTS = (("64 KiB", Layout("meta-llama/Meta-Llama-3-8B@tp4", 32, 2, 128, 2, "float16")),
           ("256 KiB", llama3_8b(block_size=2)),
           ("2 MiB", llama3_8b(block_size=16)))
CUDA_GOALS = {"64 KiB": 0.6, "256 KiB": 0.9, "2 MiB": 0.95}  # ours / one cudaMemcpyAsync of the span
CPU_GOAL = 0.8  # contiguous / memcpy, and shuffled / contiguous
DIRECTIONS = ("d2h", "h2d", "both")
CUDA_BYTES, CPU_BYTES, QUICK_BYTES = 256 << 20, 64 << 20, 8 << 20  # per direction per job


def shuffled(num_blocks: int) -> list[int]:
    """A permutation of range(num_blocks) in which no id follows its predecessor: every block its own run."""
    step = next(s for s in range(3, num_blocks + 3, 2) if math.gcd(s, num_blocks) == 1 and s % num_blocks != 1)
    ids = [i * step % num_blocks for i in range(num_blocks)]
    assert sorted(ids) == list(range(num_blocks)) and all(b != a + 1 for a, b in zip(ids, ids[1:]))
    return ids


def memcpy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """One plain copy of all bytes with libc memcpy."""
    ctypes.memmove(dst.data_ptr(), src.data_ptr(), src.numel() * src.element_size())


class CudaMemcpy:
    """cudaMemcpyAsync of all bytes (cudaMemcpyDefault: the pointers say the direction), each pair on a
    stream of its own, then a synchronize of those streams: the bare runtime call, no torch."""

    def __init__(self) -> None:
        import cupy

        self.runtime = cupy.cuda.runtime
        self.streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(2)]

    def __call__(self, *pairs: tuple[torch.Tensor, torch.Tensor]) -> None:
        for (dst, src), stream in zip(pairs, self.streams):
            self.runtime.memcpyAsync(dst.data_ptr(), src.data_ptr(), src.numel() * src.element_size(),
                                     self.runtime.memcpyDefault, stream.ptr)
        for stream in self.streams[:len(pairs)]:
            stream.synchronize()


class HostMemcpy:
    """memcpy of each pair, two pairs on two threads at once."""

    def __init__(self) -> None:
        self.threads = concurrent.futures.ThreadPoolExecutor(2)

    def __call__(self, *pairs: tuple[torch.Tensor, torch.Tensor]) -> None:
        if len(pairs) == 1:
            memcpy(*pairs[0])
            return
        for future in [self.threads.submit(memcpy, dst, src) for dst, src in pairs]:
            future.result()


class Case:
    """One block size: a pool and a slab of 2 x num_blocks, the first half for offloads, the second for loads."""

    def __init__(self, layout: Layout, nbytes: int) -> None:
        self.layout = layout
        self.num_blocks = max(4, nbytes // layout.bytes_per_block)
        self.nbytes = self.num_blocks * layout.bytes_per_block
        self.pool: DevicePool = create_device_pool(layout, 2 * self.num_blocks)
        self.host = HostTier(layout, 2 * self.nbytes)
        assert self.host.slots.is_contiguous() and self.host.slab.stride == layout.bytes_per_block
        self.pool_bytes = self.pool.tensor.view(-1).view(torch.uint8)
        self.host_bytes = self.host.slots.view(-1)
        self.pool_bytes.copy_(torch.randint(0, 256, (self.pool.nbytes,), dtype=torch.uint8))
        self.host_bytes.copy_(torch.randint(0, 256, (self.host_bytes.numel(),), dtype=torch.uint8))

    def jobs(self, engine: CopyEngine, direction: str, pool_ids: list[int]) -> Callable[[], None]:
        n, codec, pool, slots = self.num_blocks, self.host.codec, self.pool.tensor, self.host.slots
        slot_ids = list(range(n))
        load_pool_ids = [n + i for i in pool_ids]
        load_slot_ids = [n + i for i in slot_ids]

        def run() -> None:
            transfers = []
            if direction in ("d2h", "both"):
                transfers.append(engine.submit(Direction.DEVICE_TO_HOST,
                                               lambda: codec.encode(pool, pool_ids, slots, slot_ids), self.nbytes))
            if direction in ("h2d", "both"):
                transfers.append(engine.submit(Direction.HOST_TO_DEVICE,
                                               lambda: codec.decode(slots, load_slot_ids, pool, load_pool_ids),
                                               self.nbytes))
            for transfer in transfers:
                transfer.wait()
        return run

    def baseline_pairs(self, direction: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
        half = self.nbytes
        pairs = []
        if direction in ("d2h", "both"):
            pairs.append((self.host_bytes[:half], self.pool_bytes[:half]))
        if direction in ("h2d", "both"):
            pairs.append((self.pool_bytes[half:], self.host_bytes[half:]))
        return pairs

    def check(self, pool_ids: list[int]) -> None:
        """The last job put pool block pool_ids[i] into slot i, and slot n + i into block n + pool_ids[i]."""
        n = self.num_blocks
        rows = self.pool.tensor.view(torch.uint8).view(2 * n, -1)
        assert torch.equal(self.host.slots[:n], rows[pool_ids].cpu()), "an offload must copy every byte"
        assert torch.equal(rows[[n + i for i in pool_ids]].cpu(), self.host.slots[n:]), "a load must copy every byte"

    def close(self) -> None:
        self.host.close()
        self.pool.close()


def main(argv: Sequence[str] | None = None) -> int:
    args = _report.parse_args(__doc__.splitlines()[0], argv)
    rounds, warmup = (3, 1) if args.quick else (20, 3)
    on_cuda = torch.cuda.is_available()
    nbytes = QUICK_BYTES if args.quick else CUDA_BYTES if on_cuda else CPU_BYTES
    copy = CudaMemcpy() if on_cuda else HostMemcpy()
    _report.print_header(f"T0 <-> T1 copy sweep: {nbytes >> 20} MiB per direction per job, T0 on "
                         f"{'cuda:0' if on_cuda else 'cpu (/dev/shm)'}, T1 pinned={on_cuda}", args.quick)
    plain_copy = ("cudaMemcpyAsync on a stream of its own, then its synchronize; two streams for both" if on_cuda
                  else "ctypes.memmove; two threads for both")
    print(f"baseline: one plain copy of the same bytes between the same buffers ({plain_copy})")
    if on_cuda:
        print("goal: ours >= " + ", ".join(f"{g:g}x at {size}" for size, g in CUDA_GOALS.items()) +
              " of the baseline, contiguous and shuffled alike")
    else:
        print(f"goal: contiguous >= {CPU_GOAL:g}x memcpy; shuffled >= {CPU_GOAL:g}x our contiguous "
              f"(host jobs: {'one C call each' if native_available() else 'the Python span loop: no C extension'})")
    print()
    rows = []
    for size_name, layout in LAYOUTS:
        case = Case(layout, nbytes)
        engine = create_copy_engine(str(case.pool.device))
        try:
            contiguous_gb_per_s: dict[str, float] = {}
            orders = (("contiguous", list(range(case.num_blocks))), ("shuffled", shuffled(case.num_blocks)))
            for order, pool_ids in orders:
                for direction in DIRECTIONS:
                    pairs = case.baseline_pairs(direction)
                    job = case.jobs(engine, direction, pool_ids)
                    ours_t, base_t = _report.time_pair(job, lambda: copy(*pairs), rounds=rounds, warmup=warmup)
                    if direction == "both":  # once more, untimed, after the baseline's last round: check the bytes
                        job()
                        case.check(pool_ids)
                    moved = case.nbytes * len(pairs)
                    ours, base = moved / ours_t.median_ns, moved / base_t.median_ns
                    ratio = ours / base
                    if on_cuda:
                        goal = CUDA_GOALS[size_name]
                        goal_text, passed, versus = f">= {goal:g}x", ratio >= goal, "-"
                    elif order == "contiguous":
                        contiguous_gb_per_s[direction] = ours
                        goal_text, passed, versus = f">= {CPU_GOAL:g}x memcpy", ratio >= CPU_GOAL, "-"
                    else:
                        versus_ratio = ours / contiguous_gb_per_s[direction]
                        goal_text, passed = f">= {CPU_GOAL:g}x contiguous", versus_ratio >= CPU_GOAL
                        versus = f"{versus_ratio:.2f}x"
                    rows.append([f"{size_name} {order} {direction}", f"{case.num_blocks}", f"{ours:.2f}", f"{base:.2f}",
                                 f"{ratio:.2f}x", versus, goal_text, _report.verdict(passed)])
        finally:
            engine.close()
            case.close()
    _report.print_table(["blocks, ids, direction", "blocks", "ours GB/s", "baseline GB/s", "ratio",
                         "vs contiguous", "goal", "result"], rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
