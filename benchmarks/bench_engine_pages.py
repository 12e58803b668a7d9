"""The vLLM connector's engine pages <-> pool slots (EnginePages.to_pool / from_pool), fragmented ids
against contiguous ones and against one plain copy of the same bytes.

An engine allocation as vLLM 0.32 lays it out (one buffer, layer-outermost, a 64 KiB page per layer
and block: 16 tokens x 8 KV heads x (K, V) x 128 x bf16) and a pool of slots of every layer's page,
on CUDA when there is one (or with --cuda), else on the CPU. 256 blocks x 32 layers (512 MiB, a
4k-token hit of Llama-3-8B) by default; --quick: 32 blocks x 8 layers.
Ours, each direction (store: engine -> pool, load: pool -> engine):
- fragmented: engine ids shuffled, pool ids shuffled with no two adjacent (every block its own run,
  as a pool hands them out after churn);
- contiguous: blocks 0..n-1 on both sides.
Baseline, same run: one plain copy (`copy_`) of the same number of bytes between the same two
buffers. Context, same run: the per-run loop the connector ran before (an index_select and a copy
per layer per run of consecutive pool ids; 2 rounds at most, it is slow), and on CUDA the same moves with
the pool in host memory (as a /dev/shm pool; its baseline one plain copy between the device and the
host buffers). On CUDA every op is followed by a synchronize.
Goal: fragmented >= 0.8x the plain copy's GB/s, the pool beside the engine.
"""

from __future__ import annotations

import argparse
import random
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import _report  # noqa: E402
from kvtierd.connectors.vllm.engine_pages import EnginePages  # noqa: E402
from kvtierd.connectors.vllm.kv_groups import EngineGroups, GroupKind, ServedGroup  # noqa: E402

BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, DTYPE = 16, 8, 128, torch.bfloat16  # a 64 KiB page
GOAL_RATIO = 0.8


class Setup:
    """An engine allocation of `2 * num_blocks` blocks and a pool of as many slots, random bytes."""

    def __init__(self, num_blocks: int, num_layers: int, device: torch.device, pool_device: torch.device) -> None:
        self.device = device
        self.num_blocks = num_blocks
        num_engine_blocks = 2 * num_blocks
        shape = (num_layers, num_engine_blocks, NUM_KV_HEADS, BLOCK_SIZE, 2 * HEAD_DIM)  # vLLM's LBHNC
        raw = torch.randint(-128, 128, (torch.Size(shape).numel() * DTYPE.itemsize,), dtype=torch.int8,
                            device=device)
        layers = raw.view(DTYPE).view(shape)
        names = tuple(f"model.layers.{layer}.self_attn.attn" for layer in range(num_layers))
        self.page_nbytes = NUM_KV_HEADS * BLOCK_SIZE * 2 * HEAD_DIM * DTYPE.itemsize
        self.group = ServedGroup(0, GroupKind.FULL, names, self.page_nbytes, BLOCK_SIZE)
        engine = EngineGroups((self.group,), BLOCK_SIZE, BLOCK_SIZE, self.page_nbytes, uniform_attention=True)
        self.pages = EnginePages(dict(zip(names, layers)), engine, None, num_engine_blocks)
        self.pool = torch.zeros(2 * num_blocks, num_layers, self.page_nbytes // DTYPE.itemsize, dtype=DTYPE,
                                device=pool_device)
        self.engine_bytes = raw.view(torch.uint8)
        self.nbytes = num_blocks * num_layers * self.page_nbytes
        rng = random.Random(0)
        self.fragmented = (rng.sample(range(num_engine_blocks), num_blocks),
                           rng.sample(range(0, 2 * num_blocks, 2), num_blocks))  # no two pool ids adjacent
        self.contiguous = (list(range(num_blocks)), list(range(num_blocks)))

    def synced(self, op: Callable[[], object]) -> Callable[[], None]:
        def run() -> None:
            op()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        return run

    def store(self, ids: tuple[list[int], list[int]]) -> Callable[[], None]:
        return self.synced(lambda: self.pages.to_pool(self.group, ids[0], self.pool, ids[1]))

    def load(self, ids: tuple[list[int], list[int]]) -> Callable[[], None]:
        return self.synced(lambda: self.pages.from_pool(self.group, self.pool, ids[1], ids[0]))

    def plain_copy(self, to_pool: bool) -> Callable[[], None]:
        pool_bytes = self.pool.view(-1).view(torch.uint8)[:self.nbytes]
        engine_bytes = self.engine_bytes[:self.nbytes]
        dst, src = (pool_bytes, engine_bytes) if to_pool else (engine_bytes, pool_bytes)
        return self.synced(lambda: dst.copy_(src))

    def per_run_loop(self, ids: tuple[list[int], list[int]], to_pool: bool) -> Callable[[], None]:
        """The connector's copy before: per run of consecutive pool ids, per layer, an index op and a copy."""
        rows = self.pool.view(torch.uint8)
        layer_pages = self.pages.pages[self.group.group_id]

        def run() -> None:
            engine_ids = torch.tensor(ids[0], dtype=torch.int64, device=self.device)
            for offset, first, length in runs(ids[1]):
                part = engine_ids[offset:offset + length]
                for layer, pages in enumerate(layer_pages):
                    if to_pool:
                        rows[first:first + length, layer].copy_(pages.index_select(0, part))
                    else:
                        pages.index_copy_(0, part, rows[first:first + length, layer].to(self.device))
        return self.synced(run)

    def check_store(self, ids: tuple[list[int], list[int]]) -> None:
        """The pool slots hold the engine pages, every byte (before any timing)."""
        self.store(ids)()
        engine_pages = self.engine_bytes.view(len(self.group.layer_names), -1, self.page_nbytes)
        expected = engine_pages[:, ids[0]].transpose(0, 1).to(self.pool.device)
        assert torch.equal(self.pool.view(torch.uint8)[ids[1]], expected), "a store must copy every byte"


def runs(pool_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """(offset in the list, first id, length) of each run of consecutive ids."""
    found, start = [], 0
    for index in range(1, len(pool_ids) + 1):
        if index == len(pool_ids) or pool_ids[index] != pool_ids[index - 1] + 1:
            found.append((start, pool_ids[start], index - start))
            start = index
    return found


def choose_device(args: argparse.Namespace) -> torch.device:
    if args.cuda and not torch.cuda.is_available():
        raise SystemExit("--cuda: torch.cuda.is_available() is false")
    return torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")


def table_rows(setup: Setup, rounds: int, warmup: int, judged: bool) -> list[list[str]]:
    """A row per direction: fragmented, contiguous, one copy, the per-run loop (GB/s), the ratios, the verdict."""
    rows = []
    for name, to_pool in [("store (engine -> pool)", True), ("load (pool -> engine)", False)]:
        move = setup.store if to_pool else setup.load
        timings = _report.time_interleaved([move(setup.fragmented), move(setup.contiguous),
                                            setup.plain_copy(to_pool)], rounds=rounds, warmup=warmup)
        timings += _report.time_interleaved([setup.per_run_loop(setup.fragmented, to_pool)],
                                            rounds=min(rounds, 2), warmup=0)
        gb_per_s = [setup.nbytes / timing.median_ns for timing in timings]
        ratio = gb_per_s[0] / gb_per_s[2]
        where = "" if setup.pool.device == setup.device else f", pool on {setup.pool.device}"
        rows.append([name + where, *(f"{value:.2f}" for value in gb_per_s), f"{gb_per_s[0] / gb_per_s[1]:.2f}x",
                     f"{ratio:.2f}x", f">= {GOAL_RATIO:g}x" if judged else "(context)",
                     _report.verdict(ratio >= GOAL_RATIO) if judged else "-"])
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = _report.argument_parser(__doc__.splitlines()[0])
    parser.add_argument("--cuda", action="store_true", help="require CUDA (the default uses it where present)")
    parser.add_argument("--cpu", action="store_true", help="run on the CPU even where CUDA is present")
    args = parser.parse_args(argv)
    device = choose_device(args)
    num_blocks, num_layers = (32, 8) if args.quick else (256, 32)
    rounds, warmup = (3, 1) if args.quick else (15, 3)
    setups = [Setup(num_blocks, num_layers, device, device)]
    if device.type == "cuda":  # context: the pool in host memory, as a /dev/shm pool
        setups.append(Setup(num_blocks, num_layers, device, torch.device("cpu")))
    for setup in setups:
        setup.check_store(setup.fragmented)
        setup.check_store(setup.contiguous)
    first = setups[0]
    _report.print_header(f"engine pages <-> pool slots: {num_blocks} blocks x {num_layers} layers x "
                         f"{first.page_nbytes >> 10} KiB ({first.nbytes >> 20} MiB) on {device}", args.quick)
    print("ours: EnginePages.to_pool / from_pool with fragmented ids (every block its own run) and contiguous ids; "
          "baseline: one plain copy_ of the same bytes between the same buffers; context: the per-run loop "
          f"(<= 2 rounds){' and the pool on the host' if len(setups) > 1 else ''}")
    print(f"goal: fragmented >= {GOAL_RATIO:g}x the plain copy (GB/s)")
    print()
    rows = [row for index, setup in enumerate(setups) for row in table_rows(setup, rounds, warmup, judged=index == 0)]
    _report.print_table(["direction", "fragmented GB/s", "contiguous GB/s", "one copy GB/s", "per-run loop GB/s",
                         "fragmented / contiguous", "fragmented / copy", "goal", "result"], rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
