"""Promotion of a 4k-token prefix (256 blocks of 2 MiB, Llama-3-8B fp16) from T1 and from T2.

Ours: `TierManager.acquire` of the prompt's 256 hashes with the prefix held only in T1 (or only
in T2), then `ticket.wait()`: the time until the blocks are in T0, verified (T2: checksums),
and committed. Baselines, the same bytes in the same run: for T1, one memcpy from the host
slab into the device pool; for T2, one sequential O_DIRECT read of a file of the same size
into an aligned buffer, plus that memcpy (the raw cost of SSD → host → T0).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import _report  # noqa: E402
from kvtierd.block_hash import Namespace  # noqa: E402
from kvtierd.layout import llama3_8b  # noqa: E402
from kvtierd.t2.ssd_tier import SsdTierConfig  # noqa: E402
from kvtierd.tiering.tier_config import EdgePolicy, TierConfig  # noqa: E402
from kvtierd.tiering.tier_manager import TierManager  # noqa: E402


def raw_read(path: str, buffer: mmap.mmap) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
    try:
        view, done = memoryview(buffer), 0
        while done < len(buffer):
            done += os.preadv(fd, [view[done:]], done)
    finally:
        os.close(fd)


def main(argv: Sequence[str] | None = None) -> int:
    args = _report.parse_args(__doc__.splitlines()[0], argv)
    num_blocks = 16 if args.quick else 256
    rounds, warmup = (3, 1) if args.quick else (12, 2)
    layout = llama3_8b()
    namespace = Namespace(layout, tenant="bench")
    prompt = np.random.default_rng(7).integers(0, 128_000, num_blocks * layout.block_size).tolist()
    chain = namespace.hash_blocks(prompt)
    nbytes = num_blocks * layout.bytes_per_block
    with tempfile.TemporaryDirectory(dir=os.environ.get("KVTIERD_BENCH_DIR", "/var/tmp")) as scratch:
        manager = TierManager(layout, num_blocks,
                              TierConfig(host_capacity_bytes=nbytes, t0_to_t1=EdgePolicy.WRITE_THROUGH),
                              ssd_config=SsdTierConfig([os.path.join(scratch, "ssd")], capacity_bytes=nbytes * 2),
                              root=namespace.root)
        raw_path = os.path.join(scratch, "raw.bin")
        with open(raw_path, "wb") as f:
            f.write(os.urandom(1 << 20) * (nbytes >> 20))
        aligned = mmap.mmap(-1, nbytes)
        try:
            acquisition = manager.acquire("seed", chain, 0, prompt)
            manager.device_pool.tensor.copy_(torch.randn(manager.device_pool.tensor.shape).to(layout.torch_dtype))
            manager.commit("seed", 0, chain, prompt, namespace.root)
            expected = manager.device_pool.tensor[acquisition.block_ids].clone()
            manager.release("seed")
            manager.drain()
            assert manager.lookup(chain, prompt).t0 == num_blocks and manager.tiers.ssd.lookup(chain) == num_blocks

            def only_below(tier: str) -> None:
                manager.drain()
                manager.index.evict(chain)
                if tier == "t2":
                    manager.tiers.host.index.remove(chain)
                hits = manager.lookup(chain, prompt)
                assert (hits.t0, hits.t1 if tier == "t1" else hits.t2) == (0, num_blocks), hits

            def promote() -> None:
                acquisition = manager.acquire("bench", chain, 0, prompt)
                assert acquisition.ticket.wait(120) == num_blocks
                manager.release("bench")

            host_bytes = manager.tiers.host.slots.reshape(-1)[:nbytes]
            pool_bytes = manager.device_pool.tensor.view(-1).view(torch.uint8)

            def memcpy() -> None:
                ctypes.memmove(pool_bytes.data_ptr(), host_bytes.data_ptr(), nbytes)

            def read_and_copy() -> None:
                raw_read(raw_path, aligned)
                ctypes.memmove(pool_bytes.data_ptr(), ctypes.addressof(ctypes.c_char.from_buffer(aligned)), nbytes)

            _report.print_header(f"Promotion of a {num_blocks * layout.block_size}-token prefix ({num_blocks} blocks, "
                                 f"{nbytes >> 20} MiB) into T0 on {manager.device_pool.device}", args.quick)
            print("baselines: T1, one memcpy host slab -> pool of the same bytes; T2, one sequential O_DIRECT read "
                  "of a file of the same size plus that memcpy")
            print()
            rows = []
            for tier, baseline in [("t1", memcpy), ("t2", read_and_copy)]:
                ours_t, base_t = _report.time_pair(promote, baseline, rounds=rounds, warmup=warmup,
                                                   ours_setup=lambda tier=tier: only_below(tier))
                only_below(tier)
                promote_check = manager.acquire("check", chain, 0, prompt)
                promote_check.ticket.wait(120)
                promoted = manager.device_pool.tensor[promote_check.block_ids]
                assert torch.equal(promoted, expected), "promoted bytes differ"
                manager.release("check")
                rows.append([f"from {tier.upper()}",
                             _report.median_and_best(ours_t.median_ns / 1e6, ours_t.best_ns / 1e6, 1),
                             _report.median_and_best(base_t.median_ns / 1e6, base_t.best_ns / 1e6, 1),
                             f"{nbytes / ours_t.median_ns:.2f}", f"{base_t.median_ns / ours_t.median_ns:.2f}x"])
            _report.print_table(["promotion", "ours ms", "baseline ms", "ours GB/s", "baseline/ours"], rows)
        finally:
            aligned.close()
            manager.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
