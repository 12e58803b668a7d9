"""The daemon's CPU per stored block on the vLLM connector's store path, by how many blocks one store carries.

Ours: a real `kvtierd serve` set up as bench_vllm_serve's random phase sets it (T0 256 MiB, T1 512 MiB,
T2 1 GiB, write-through T0 -> T1 -> T2, one layout) and a client that stores as the connector's worker
does, one store job after another: Acquire the job's blocks for_store, write each block's bytes into
the mapped pool, Commit them and release in the same call. Blocks of 737,280 bytes, the size of
SmolLM2-135M's bf16 block of 32 tokens, 256 at a time, then a wait until T2 holds every block T0
caches (T0 holds a round and its write-through backlog; a store faster than the disk would find T0
full). The daemon's CPU (/proc user + system) from the first Acquire to the last round's write to T2
(its write-through included, and its answers to the waits' Stats calls, every 0.2 s), over the blocks
stored; one new daemon per job size. Then the goal's job size again with 4 stores at once, on 4 threads of
one session (a vLLM worker's step stores a job per request, each on its own thread).

Baseline, the same run: the floor of a stored block's bytes in this process (one copy, an xxh3-64
checksum, an O_DIRECT write and a share of one fdatasync per 16 blocks: bench_vllm_serve's
`bytes_floor_cpu_ms`). The ratio says how far the daemon is above what the bytes themselves cost;
the per-store column, from the smallest and largest job sizes, splits the daemon's CPU into a
fixed part per store (its RPCs, its copies' hand-offs) and a part per block.

Goal (bench_vllm_serve's, here without an engine): <= 0.5 ms of daemon CPU per stored block at 8
blocks a store (a 256-token chunk of blocks of 32). Reported, not asserted.

Run: python benchmarks/bench_store_cpu.py [--quick]
"""

from __future__ import annotations

import os
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import _report  # noqa: E402
from benchmarks.bench_vllm_serve import bytes_floor_cpu_ms, process_cpu_s, start_daemon  # noqa: E402
from kvtierd.client import KvtierClient  # noqa: E402
from kvtierd.errors import ResourceExhausted  # noqa: E402
from kvtierd.launch.daemon_process import wait_until, written_through  # noqa: E402
from kvtierd.layout import Layout  # noqa: E402

LAYOUT = Layout("bench-store-cpu", 30, 3, 64, 32)  # 737,280 bytes: SmolLM2-135M's 16-bit block of 32 tokens
JOB_SIZES = (2, 8, 32)  # blocks per store
ROUND_BLOCKS = 256  # stored before waiting for T2 to have them: T0 (364 blocks) holds them and their backlog
GOAL_JOB_BLOCKS, GOAL_CPU_MS = 8, 0.5
NUM_AT_ONCE = 4  # stores at once in the last row


def daemon_cpu_ms_per_block(blocks_per_store: int, num_rounds: int, num_at_once: int = 1) -> float:
    """A new daemon's CPU per block over `num_rounds` rounds of ROUND_BLOCKS blocks stored
    `blocks_per_store` at a time by `num_at_once` threads, each round until T2 has them (a round fits
    T0 with its write-through backlog: faster than the disk, stores would find T0 full of blocks
    waiting to go down)."""
    block = os.urandom(LAYOUT.bytes_per_block)
    num_stores = ROUND_BLOCKS // blocks_per_store
    with tempfile.TemporaryDirectory(prefix="kvsc-") as directory, start_daemon(directory) as daemon, \
            KvtierClient(daemon.address) as client, client.attach(LAYOUT) as session:
        pool = session.pool
        assert pool is not None, "attached with the pool mapped"

        def store_one(store: int) -> None:
            tokens = [(store * 100_003 + i) % 50_000 for i in range(blocks_per_store * LAYOUT.block_size)]
            hashes = session.namespace.hash_blocks(tokens)
            try:
                acquired = session.acquire(f"s{store}", hashes, token_ids=tokens, for_store=True)
            except ResourceExhausted:  # T0 full of blocks still on their way down (a slow disk): wait, once
                wait_for_t2(client)
                acquired = session.acquire(f"s{store}", hashes, token_ids=tokens, for_store=True)
            for block_id in acquired.block_ids:
                pool.write_block(block_id, block)
            session.commit_and_release(f"s{store}", acquired.block_ids, hashes, tokens, None)

        errors: list[BaseException] = []

        def store_every(first: int, stores: range) -> None:  # one thread's share of a round
            try:
                for store in stores[first::num_at_once]:
                    store_one(store)
            except BaseException as error:  # the run fails below, not one thread in silence
                errors.append(error)

        cpu_before = process_cpu_s(daemon.pid)
        for round_index in range(num_rounds):
            stores = range(round_index * num_stores, (round_index + 1) * num_stores)
            threads = [threading.Thread(target=store_every, args=(first, stores)) for first in range(num_at_once)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            if errors:
                raise SystemExit(f"bench_store_cpu: a store failed: {errors[0]!r}")
            wait_for_t2(client)
        return (process_cpu_s(daemon.pid) - cpu_before) * 1e3 / (num_rounds * num_stores * blocks_per_store)


def wait_for_t2(client: KvtierClient) -> None:
    """Until T2 holds every block T0 caches (polled every 0.2 s: each poll is a Stats call the daemon answers)."""
    if not wait_until(lambda: written_through(client), timeout_s=120, period_s=0.2):
        raise SystemExit(f"bench_store_cpu: the blocks did not reach T2 within 120 s: {client.stats()}")


def main(argv: list[str] | None = None) -> int:
    args = _report.parse_args(__doc__.splitlines()[0] if __doc__ else "bench_store_cpu", argv)
    num_rounds = 1 if args.quick else 4
    with tempfile.TemporaryDirectory(prefix="kvsc-floor-") as directory:
        floor_ms = bytes_floor_cpu_ms(Path(directory), LAYOUT.bytes_per_block)
    cpu_ms = {size: daemon_cpu_ms_per_block(size, num_rounds) for size in JOB_SIZES}
    at_once_ms = daemon_cpu_ms_per_block(GOAL_JOB_BLOCKS, num_rounds, NUM_AT_ONCE)
    small, large = JOB_SIZES[0], JOB_SIZES[-1]
    per_block_ms = (cpu_ms[large] * large - cpu_ms[small] * small) / (large - small)
    per_store_ms = cpu_ms[small] * small - per_block_ms * small
    _report.print_header("the daemon's CPU per stored block, by blocks per store", args.quick,
                         timing_note="timing: /proc user + system CPU of the daemon; the floor: this process's")
    print(f"{num_rounds} x {ROUND_BLOCKS} blocks of {LAYOUT.bytes_per_block:,} bytes per job size, each round "
          f"until T2 has it, write-through T0 -> T1 -> T2; "
          f"the bytes' floor {floor_ms:.3f} ms per block; from {small} and {large} blocks a store: "
          f"{per_store_ms:.2f} ms per store + {per_block_ms:.3f} ms per block")
    _report.print_table(["blocks per store", "daemon CPU ms per block", "the bytes' floor ms", "x the floor"],
                        [[str(size), f"{cpu_ms[size]:.3f}", f"{floor_ms:.3f}", f"{cpu_ms[size] / floor_ms:.1f}x"]
                         for size in JOB_SIZES]
                        + [[f"{GOAL_JOB_BLOCKS}, {NUM_AT_ONCE} stores at once", f"{at_once_ms:.3f}", f"{floor_ms:.3f}",
                            f"{at_once_ms / floor_ms:.1f}x"]])
    goal_ms = cpu_ms[GOAL_JOB_BLOCKS]
    _report.print_goals([(f"daemon CPU per stored block <= {GOAL_CPU_MS} ms at {GOAL_JOB_BLOCKS} blocks a store "
                          f"({goal_ms:.3f} ms, {goal_ms / floor_ms:.1f}x the bytes' floor; {NUM_AT_ONCE} stores at "
                          f"once: {at_once_ms:.3f} ms)", goal_ms <= GOAL_CPU_MS)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
