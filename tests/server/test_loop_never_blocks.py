"""The event loop never waits on a disk: under one client's eviction pressure a real daemon whose
slot-file writes each sleep 1 s writes every block to T2 on a thread that runs no event loop, while
another client's Lookups go on (their latencies are printed beside the unloaded ones: a figure, not
a verdict)."""

from __future__ import annotations

import multiprocessing
import os
import time

import pytest

from kvtierd.client import KvtierClient
from kvtierd.launch.daemon_process import DaemonProcess, small_daemon_args, wait_until
from tests.server.e2e_runner import LAYOUT, expected_block, prompt

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WRITE_DELAY_S = 1.0  # per slot-file write: a blocking loop stalls a Lookup ~1000x its normal time
ON_EVICT = ["--set", "policy.t0_to_t1=on_evict", "--set", "policy.t1_to_t2=on_evict"]
NUM_ROUNDS = 3  # rounds of (no pressure, pressure): machine noise drifts, it does not pick a phase
NUM_BASELINE_SAMPLES = 500  # per round
NUM_PRESSURE_SAMPLES = 150  # per round, at least
NUM_SLOW_WRITES = 3  # per round: T2 stores of 8 blocks (one slot-file write each) while Lookups run
DEADLINE_S = 30.0  # per wait
MAX_PRESSURE_CYCLES = 400


def p99(samples: list[float]) -> float:
    return sorted(samples)[int(0.99 * (len(samples) - 1))]


def tier(client: KvtierClient, name: str):
    pool, = [p for p in client.stats().pools if p.layout.model_id == LAYOUT.model_id]
    return next(t for t in pool.tiers if t.tier == name)


def lookups(session, hashes, tokens, num_samples: int, until=lambda: True) -> list[float]:
    """Lookup latencies (s): `num_samples` of them at least, and on until `until()` (asked every
    50 samples) or the deadline."""
    samples = []
    deadline = time.monotonic() + DEADLINE_S
    while (len(samples) < num_samples or len(samples) % 50 or not until()) and time.monotonic() < deadline:
        start = time.perf_counter()
        response = session.lookup(hashes, token_ids=tokens)
        samples.append(time.perf_counter() - start)
        assert response.total.t0 == 8
    return samples


def press(address: str, pressing, paused, stopping, num_cycles) -> None:
    """In a child process (its client must not share this one's GIL), niced and with its blocks
    made up front, so that what it costs the CPU is mostly the daemon's work: Puts of 8 fresh
    blocks while `pressing` is set; `paused` once it stopped. Once T0 and T1 are full, every Put
    evicts 8 blocks from T0 into T1, and T1 spills 8 to T2."""
    os.nice(10)
    with KvtierClient(address) as client:
        namespace = client.attach(LAYOUT, map_pool=False).namespace
        puts = []
        for seed in range(1000, 1000 + MAX_PRESSURE_CYCLES):
            tokens = prompt(seed, 32)
            puts.append([(h, tokens[4 * i:4 * i + 4], expected_block(h, LAYOUT.bytes_per_block))
                         for i, h in enumerate(namespace.hash_blocks(tokens))])
        for blocks in puts:
            if not pressing.is_set():
                paused.set()
                pressing.wait()
            if stopping.is_set():
                return
            assert client.put(LAYOUT, blocks).num_blocks == 8
            num_cycles.value += 1
        raise AssertionError(f"the test needed more than {MAX_PRESSURE_CYCLES} Puts")


class Pressure:
    """The pressing client, in a spawned process."""

    def __init__(self, address: str) -> None:
        context = multiprocessing.get_context("spawn")
        self.pressing, self.paused, self.stopping = context.Event(), context.Event(), context.Event()
        self.num_cycles = context.Value("i", 0)
        self.process = context.Process(target=press, args=(address, self.pressing, self.paused, self.stopping,
                                                           self.num_cycles), daemon=True)
        self.process.start()

    @property
    def failed(self) -> bool:
        return self.process.exitcode not in (None, 0)

    def resume(self) -> None:
        self.paused.clear()
        self.pressing.set()

    def pause(self) -> None:
        """Return once no cycle is in flight."""
        self.pressing.clear()
        assert self.paused.wait(DEADLINE_S), "the pressing client did not pause"

    def stop(self) -> int:
        self.stopping.set()
        self.pressing.set()
        self.process.join(DEADLINE_S)
        return self.process.exitcode


@pytest.mark.slow  # tens of seconds of slow writes
def test_a_slow_t2_under_eviction_pressure_is_written_off_the_event_loop(tmp_path):
    """Every slow slot-file write ran on a thread without an event loop (none on the daemon's loop),
    and they ran while another client's Lookups went on."""
    threads_file = tmp_path / "write-threads"
    args = small_daemon_args(str(tmp_path), t0_bytes="64KiB", host_bytes="64KiB", extra=ON_EVICT)
    env = {"SLOW_T2_WRITE_DELAY_S": str(WRITE_DELAY_S), "PYTHONPATH": REPO, "SLOW_T2_THREADS_FILE": str(threads_file)}
    with DaemonProcess(args, env=env, module="tests.server.slow_t2_serve") as daemon, \
            KvtierClient(daemon.address) as measured:
        reader = measured.attach(LAYOUT, map_pool=False)
        tokens = prompt(1, 64)
        hashes = reader.namespace.hash_blocks(tokens)
        held = reader.acquire("held", hashes[:8], token_ids=tokens[:32])
        reader.commit("held", held.block_ids, hashes[:8], tokens[:32], None)  # held: never evicted
        spilled = lambda: tier(measured, "t2").num_cached_blocks  # noqa: E731  (T2 starts empty)
        drained = lambda: spilled() == tier(measured, "t1").num_evictions  # noqa: E731  every T1 victim landed

        pressure = Pressure(daemon.address)
        baseline, during, num_cycles, num_written = [], [], 0, 0
        try:
            pressure.resume()  # T0 (64 blocks) and T1 (16 slots) fill in ~10 cycles
            assert wait_until(lambda: spilled() > 0 or pressure.failed, DEADLINE_S), "no block reached T2"
            for _ in range(NUM_ROUNDS):
                pressure.pause()
                assert wait_until(drained, DEADLINE_S), "T1's victims never all reached T2"
                baseline += lookups(reader, hashes, tokens, NUM_BASELINE_SAMPLES)
                cycles_at_start, written_at_start = pressure.num_cycles.value, spilled()
                pressure.resume()
                during += lookups(reader, hashes, tokens, NUM_PRESSURE_SAMPLES, until=lambda: pressure.failed or (
                    spilled() - written_at_start >= 8 * NUM_SLOW_WRITES))
                num_cycles += pressure.num_cycles.value - cycles_at_start
                num_written += spilled() - written_at_start
        finally:
            exitcode = pressure.stop()
        assert exitcode == 0, f"the pressing client failed ({exitcode}): see its stderr"
    figures = (f"lookup p99 {p99(during) * 1e3:.2f} ms under pressure ({len(during)} samples, "
               f"{num_cycles} evicting cycles, {num_written} blocks written to the slow T2) vs "
               f"{p99(baseline) * 1e3:.2f} ms without ({len(baseline)} samples), {NUM_ROUNDS} rounds")
    print(figures)
    threads = threads_file.read_text().split()
    assert num_written >= 8 * NUM_SLOW_WRITES * NUM_ROUNDS, figures  # the disk was slow while the Lookups ran
    assert threads and "loop" not in threads, threads  # every slow write ran off the daemon's event loop
