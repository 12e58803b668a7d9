"""SSD tier: T1 → T2 store and T2 → T1 load of 64 × 2 MiB blocks, beside raw sequential file I/O.

Ours: `SsdTier.store` of 64 Llama-3-8B blocks (2 MiB each, 128 MiB) from a host slab (page-aligned
anonymous mmap, as the T1 slab is) and `SsdTier.load` of the same 64 blocks back into a slab:
batched pwritev/preadv on the tier's I/O threads, xxh3_64 checksums written and verified, the
LMDB index transaction, fdatasync of the slot file (durability "fdatasync"). Extra rows: the
same from/to an unaligned `torch.empty` tensor, which the tier stages through aligned buffers.

Baseline ("raw"): the same 128 MiB written and read sequentially in 8 MiB pwritev/preadv calls on
one preallocated file in the same directory, with the same flags: O_DIRECT when the tier uses
it, and one fdatasync after the writes. Goal: ours >= 0.7x raw throughput.

Page cache: the page cache cannot be dropped without privileges, so reads use O_DIRECT on both
sides (they hit the device, not a cached copy). If the filesystem refuses O_DIRECT, both sides
fall back to buffered I/O, reads then measure the page cache, and the output says so.

Encryption ([encryption] on): the same store and verified load on a second tier whose slots hold
each block sealed under its tenant's data key (AES-256-GCM, a random nonce per write, the tag
checked on every read instead of the xxh3 checksum), timed alternately with the tier in the clear
on the same rounds. Goal: sealed >= 0.9x the clear tier's throughput.

Files go to a temporary directory under $KVTIERD_BENCH_SSD_DIR (default: the system temp dir);
point it at the device to measure. Untimed setup between rounds: the blocks stored by the
previous round are removed (so every store writes 64 new blocks and nothing is evicted) and the
previous round's counts and bytes are checked.
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import _report  # noqa: E402
from kvtierd.index.slot_entry import BlockMeta  # noqa: E402
from kvtierd.layout import llama3_8b  # noqa: E402
from kvtierd.sealing.key_directory import KeyDirectory  # noqa: E402
from kvtierd.sealing.master_key import MasterKey  # noqa: E402
from kvtierd.sealing.tenant_keys import TenantKeys  # noqa: E402
from kvtierd.t2.ssd_tier import SsdTier, SsdTierConfig  # noqa: E402

LAYOUT = llama3_8b()
BLOCK_NBYTES = LAYOUT.bytes_per_block  # 2 MiB
NUM_BLOCKS = 64
TOTAL_NBYTES = NUM_BLOCKS * BLOCK_NBYTES
RAW_CHUNK_NBYTES = 8 << 20
GOAL_RATIO = 0.7
SEALED_GOAL_RATIO = 0.9  # sealed over clear


def aligned_slab() -> torch.Tensor:
    """[64, 2 MiB] uint8 over a page-aligned anonymous mmap, like the T1 host slab."""
    return torch.frombuffer(mmap.mmap(-1, TOTAL_NBYTES), dtype=torch.uint8).view(NUM_BLOCKS, BLOCK_NBYTES)


class RawFile:
    """The baseline: one preallocated file, sequential 8 MiB pwritev/preadv, same flags as ours."""

    def __init__(self, path: str, o_direct: bool) -> None:
        flags = os.O_RDWR | os.O_CREAT | (os.O_DIRECT if o_direct else 0)
        self.fd = os.open(path, flags, 0o600)
        os.posix_fallocate(self.fd, 0, TOTAL_NBYTES)

    def write(self, slab: torch.Tensor) -> None:
        view = memoryview(slab.view(-1).numpy())
        for offset in range(0, TOTAL_NBYTES, RAW_CHUNK_NBYTES):
            assert os.pwritev(self.fd, [view[offset:offset + RAW_CHUNK_NBYTES]], offset) == RAW_CHUNK_NBYTES
        os.fdatasync(self.fd)

    def read(self, slab: torch.Tensor) -> None:
        view = memoryview(slab.view(-1).numpy())
        for offset in range(0, TOTAL_NBYTES, RAW_CHUNK_NBYTES):
            assert os.preadv(self.fd, [view[offset:offset + RAW_CHUNK_NBYTES]], offset) == RAW_CHUNK_NBYTES


class Rounds:
    """Fresh block hashes per store round; the previous round's blocks removed in setup."""

    def __init__(self, tier: SsdTier, source: torch.Tensor, tag: int) -> None:
        self.tier, self.source, self.tag = tier, source, tag
        self.round = 0
        self.metas: list[BlockMeta] = []
        self.num_stored = NUM_BLOCKS

    def next_metas(self) -> list[BlockMeta]:
        self.round += 1
        metas, parent = [], b"\x00" * 32
        for i in range(NUM_BLOCKS):
            # one tenant per Rounds: the daemon key's first 16 bytes are its tag (one data key when sealed)
            block_hash = bytes([self.tag]) * 16 + self.round.to_bytes(4, "little") + i.to_bytes(4, "little") + bytes(8)
            metas.append(BlockMeta(block_hash, parent, bytes(64)))
            parent = block_hash
        return metas

    def setup(self) -> None:
        assert self.num_stored == NUM_BLOCKS, f"a store round stored {self.num_stored} of {NUM_BLOCKS}"
        self.tier.remove([m.block_hash for m in self.metas])
        self.metas = self.next_metas()

    def store(self) -> None:
        self.num_stored = self.tier.store([(meta, self.source[i]) for i, meta in enumerate(self.metas)])


class Reader:
    """Loads the last stored round's blocks; setup checks the previous load's bytes, then clears."""

    def __init__(self, tier: SsdTier, hashes: list[bytes], out: torch.Tensor, expected: torch.Tensor) -> None:
        self.tier, self.hashes, self.out, self.expected = tier, hashes, out, expected
        self.num_loaded = None

    def setup(self) -> None:
        if self.num_loaded is not None:
            assert self.num_loaded == NUM_BLOCKS and torch.equal(self.out, self.expected), "a load returned other bytes"
        self.out.zero_()

    def load(self) -> None:
        self.num_loaded = self.tier.load(self.hashes, self.out)


def unaligned_tensor() -> torch.Tensor:
    """[64, 2 MiB] uint8 whose rows start 64 bytes past a page boundary (a torch.empty tensor)."""
    backing = torch.empty(TOTAL_NBYTES + 2 * 4096, dtype=torch.uint8)
    start = (64 - backing.data_ptr()) % 4096
    return backing[start:start + TOTAL_NBYTES].view(NUM_BLOCKS, BLOCK_NBYTES)


def throughput(timings: _report.Timings) -> tuple[float, float]:
    """(median MB/s, best MB/s)."""
    return TOTAL_NBYTES / timings.median_ns * 1e3, TOTAL_NBYTES / timings.best_ns * 1e3


def main(argv=None) -> None:
    args = _report.parse_args(__doc__.splitlines()[0], argv)
    rounds, warmup = (2, 1) if args.quick else (6, 1)
    _report.print_header(__doc__.splitlines()[0], args.quick)
    directory = tempfile.mkdtemp(prefix="kvtierd-bench-ssd-", dir=os.environ.get("KVTIERD_BENCH_SSD_DIR"))
    try:
        config = SsdTierConfig([os.path.join(directory, "t2")], capacity_bytes=2 * TOTAL_NBYTES,
                               lmdb_map_bytes=64 << 20)
        tier = SsdTier.open(config, LAYOUT)
        o_direct = tier.stats().o_direct
        raw = RawFile(os.path.join(directory, "raw.bin"), o_direct)
        rng = np.random.default_rng(0)
        aligned_source, aligned_out = aligned_slab(), aligned_slab()
        aligned_source.view(-1).copy_(torch.from_numpy(rng.integers(0, 256, TOTAL_NBYTES, dtype=np.uint8)))
        unaligned = unaligned_tensor()
        direct = "on both sides" if o_direct else "REFUSED: buffered on both sides, reads hit the page cache"
        print(f"directory {directory}; O_DIRECT {direct} (the page cache cannot be dropped without privileges);"
              f" durability fdatasync on both sides; {NUM_BLOCKS} x {BLOCK_NBYTES >> 20} MiB"
              f" = {TOTAL_NBYTES >> 20} MiB a round")
        rows = []
        raw_out = aligned_slab()
        cases = (("aligned slab", aligned_out), ("unaligned tensor, staged", unaligned))
        for tag, (label, ours_buffer) in enumerate(cases):
            ours_buffer.copy_(aligned_source)
            writer = Rounds(tier, ours_buffer, tag)
            ours, base = _report.time_pair(writer.store, lambda: raw.write(aligned_source), rounds=rounds,
                                           warmup=warmup, ours_setup=writer.setup)
            rows.append(row(f"T1 -> T2 store, {label}", ours, base))
            writer.store()  # untimed: the last setup removed the last round's blocks; these are read back
            assert writer.num_stored == NUM_BLOCKS, "the untimed store failed"
            reader = Reader(tier, [m.block_hash for m in writer.metas], ours_buffer, aligned_source)
            ours, base = _report.time_pair(reader.load, lambda: raw.read(raw_out), rounds=rounds, warmup=warmup,
                                           ours_setup=reader.setup)
            rows.append(row(f"T2 -> T1 load (verified), {label}", ours, base))
            tier.remove(reader.hashes)
        assert torch.equal(raw_out, aligned_source)
        _report.print_table(["operation", "ours MB/s", "raw MB/s", "ratio", "goal", "verdict"], rows)
        stats = tier.stats()
        print(f"tier: o_direct={stats.o_direct}, bytes_written={stats.bytes_written:,}, "
              f"bytes_read={stats.bytes_read:,}, num_corrupted={stats.num_corrupted_blocks}")
        master = MasterKey(os.urandom(32))
        keys = TenantKeys(master, KeyDirectory.open(os.path.join(directory, "keys"), master))
        sealed = SsdTier.open(dataclasses.replace(config, directories=[os.path.join(directory, "t2-sealed")],
                                                  tenant_keys=keys), LAYOUT)
        print(f"\nencryption: the same blocks on a sealed tier (slot {sealed.stride:,} bytes: the block, a 12-byte "
              f"nonce and a 16-byte tag, 4 KiB aligned) beside the clear tier, timed alternately")
        _report.print_table(["operation", "sealed MB/s", "clear MB/s", "ratio", "goal", "verdict"],
                            sealed_rows(sealed, tier, aligned_source, rounds, warmup))
        stats = sealed.stats()
        print(f"sealed tier: bytes_written={stats.bytes_written:,}, bytes_read={stats.bytes_read:,}, "
              f"num_unauthentic={stats.num_unauthentic_blocks}")
        sealed.close()
        tier.close()
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def sealed_rows(sealed: SsdTier, clear: SsdTier, source: torch.Tensor, rounds: int, warmup: int) -> list[list[str]]:
    """Store, then verified load, of the same 64 blocks on the sealed and the clear tier, alternately."""
    writers = [Rounds(sealed, source, 10), Rounds(clear, source, 11)]

    def setup_both() -> None:
        for writer in writers:
            writer.setup()

    ours, base = _report.time_pair(writers[0].store, writers[1].store, rounds=rounds, warmup=warmup,
                                   ours_setup=setup_both)
    rows = [row("T1 -> T2 store, aligned slab", ours, base, SEALED_GOAL_RATIO)]
    readers = []
    for writer in writers:
        writer.store()  # untimed: the last setup removed the last round's blocks; these are read back
        assert writer.num_stored == NUM_BLOCKS, "the untimed store failed"
        readers.append(Reader(writer.tier, [m.block_hash for m in writer.metas], aligned_slab(), source))

    def clear_both() -> None:
        for reader in readers:
            reader.setup()

    ours, base = _report.time_pair(readers[0].load, readers[1].load, rounds=rounds, warmup=warmup,
                                   ours_setup=clear_both)
    rows.append(row("T2 -> T1 load (verified), aligned slab", ours, base, SEALED_GOAL_RATIO))
    return rows


def row(label: str, ours: _report.Timings, base: _report.Timings, goal: float = GOAL_RATIO) -> list[str]:
    ours_mbs, base_mbs = throughput(ours), throughput(base)
    ratio = ours_mbs[0] / base_mbs[0]
    return [label, _report.median_and_best(*ours_mbs), _report.median_and_best(*base_mbs), f"{ratio:.2f}x",
            f">= {goal}x", _report.verdict(ratio >= goal)]


if __name__ == "__main__":
    main()
