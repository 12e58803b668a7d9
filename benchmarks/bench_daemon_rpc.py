"""Daemon RPCs: Lookup, and Acquire + Release, of a 4k-token prompt, beside grpc.aio's own floor.

Ours: a real `kvtierd serve` (a child process, kvtierd.launch.daemon_process) on a unix socket, driven by
AsyncKvtierClient. The prompt, 4,096 token ids in blocks of 16 (256 sha256 block hashes), is put
once before timing, so every Lookup and Acquire is a 100 % T0 hit: a runner re-using a system
prompt. Token ids go with every call as a list[int] (the client packs them, 16 KiB a call). The
layout is tiny (4 KiB a block) and T0 holds 16,384 blocks: room for 32 clients x 256 blocks.
(a) one Lookup; (b) one Acquire then one Release: two RPCs, timed as a pair.

Baseline, the floor: a grpc.aio server set up like the daemon (uvloop, the same unix-socket
options and message limits; benchmarks/_grpc_floor.py, its own process) answering one empty
unary call, bytes in and out, no interceptor and no protobuf; called on a raw grpc.aio channel
with the client's channel options, deadline and metadata. For (b) the floor is two empty calls
in a row. So the ratio is what kvtierd (client library, interceptor, servicer, index) adds over
grpc.aio itself. Goal: ours p50 <= 2x the floor's p50.

Load: this process is the only client, one grpc.aio channel per server on one event loop, with
1, 8 and 32 concurrent tasks (each task its own session), each looping calls for a fixed wall
time; per-call latency by perf_counter_ns. Ours and the floor alternate, window by window.
Context (not judged): the floor sent our request's bytes (the serialized LookupRequest, or the
AcquireRequest then the ReleaseRequest), to show what the payload alone costs the transport;
and the CPU time per call of this client process and of the server process (/proc), to place a
miss on the client's side or the daemon's (on a small machine the latency is mostly CPU time).
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import itertools
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import grpc
import grpc.aio
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import _grpc_floor, _report  # noqa: E402
from kvtierd.chain_lookup import ChainLookup  # noqa: E402
from kvtierd.client import AsyncKvtierClient, AsyncSession, KvtierClient  # noqa: E402
from kvtierd.client.base import channel_options  # noqa: E402
from kvtierd.launch.daemon_process import DaemonProcess, small_daemon_args  # noqa: E402
from kvtierd.layout import Layout  # noqa: E402
from kvtierd.token_bytes import pack_token_ids  # noqa: E402
from kvtierd.v1 import kvtier_pb2 as pb  # noqa: E402

NUM_PROMPT_TOKENS = 4096
BLOCK_SIZE = 16
NUM_PROMPT_BLOCKS = NUM_PROMPT_TOKENS // BLOCK_SIZE  # 256
LAYOUT = Layout("bench-rpc", num_layers=2, num_kv_heads=2, head_dim=16, block_size=BLOCK_SIZE)  # 4 KiB a block
CONCURRENCIES = (1, 8, 32)
T0_BYTES = "64MiB"  # 16,384 blocks of 4 KiB: 32 clients x 256 blocks fit twice
MAX_MESSAGE_BYTES = 16 << 20  # daemon, floor server and both channels alike
CALL_TIMEOUT_S = 5.0  # the client's default deadline, on the floor's calls too
VOCAB_SIZE = 128_256  # Llama 3
GOAL_RATIO = 2.0

Op = Callable[[], Awaitable[object]]


@dataclasses.dataclass(slots=True)
class Load:
    """Per-call latencies of one side, pooled over its windows, the wall time they took, and the
    CPU time the client (this process, all threads) and the server process spent meanwhile."""

    latency_ns: list[int] = dataclasses.field(default_factory=list)
    elapsed_ns: int = 0
    client_cpu_ns: int = 0
    server_cpu_ns: int = 0

    def percentile_us(self, q: float) -> float:
        ordered = sorted(self.latency_ns)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] / 1e3

    @property
    def calls_per_s(self) -> float:
        return len(self.latency_ns) / (self.elapsed_ns / 1e9)

    def cpu_us_per_call(self, cpu_ns: int) -> float:
        return cpu_ns / 1e3 / len(self.latency_ns)


def process_cpu_ns(pid: int) -> int:
    """User + system CPU time of a process, all its threads (Linux /proc; 0 elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
    except OSError:
        return 0
    return (int(fields[11]) + int(fields[12])) * 1_000_000_000 // os.sysconf("SC_CLK_TCK")  # utime + stime


async def run_window(ops: Sequence[Op], duration_s: float, check: Callable[[object], None], load: Load | None,
                     server_pid: int = 0) -> None:
    """Each op loops in its own task for `duration_s`; latencies go to `load` (None: warm-up)."""
    clock = time.perf_counter_ns
    deadline = clock() + int(duration_s * 1e9)
    client_cpu, server_cpu = time.process_time_ns(), process_cpu_ns(server_pid)
    samples: list[int] = []

    async def worker(op: Op) -> None:
        while clock() < deadline:
            start = clock()
            result = await op()
            samples.append(clock() - start)
            check(result)

    start = clock()
    await asyncio.gather(*(worker(op) for op in ops))
    if load is not None:
        load.elapsed_ns += clock() - start
        load.client_cpu_ns += time.process_time_ns() - client_cpu
        load.server_cpu_ns += process_cpu_ns(server_pid) - server_cpu
        load.latency_ns += samples


@dataclasses.dataclass(slots=True)
class Side:
    """One side of a comparison: how to make task i's op, and what every result must be."""

    name: str
    make_op: Callable[[int], Op]
    server_pid: int
    check: Callable[[object], None] = lambda result: None


async def compare(sides: Sequence[Side], concurrency: int, *, rounds: int, window_s: float,
                  warmup_s: float) -> list[Load]:
    """Warm each side up, then `rounds` windows of each side in turn (ours, floor, ours, floor, ...)."""
    ops = [[side.make_op(i) for i in range(concurrency)] for side in sides]
    for side, side_ops in zip(sides, ops):
        await run_window(side_ops, warmup_s, side.check, None)
    loads = [Load() for _ in sides]
    gc.collect()
    gc.disable()  # as _report does: a collection would land on one side by chance
    try:
        for _ in range(rounds):
            for side, side_ops, load in zip(sides, ops, loads):
                await run_window(side_ops, window_s, side.check, load, side.server_pid)
    finally:
        gc.enable()
    return loads


def make_prompt(rng: np.random.Generator, namespace) -> tuple[list[int], list[bytes]]:
    token_ids = rng.integers(0, VOCAB_SIZE, NUM_PROMPT_TOKENS, dtype=np.uint32).tolist()
    block_hashes = namespace.hash_blocks(token_ids)
    assert len(block_hashes) == NUM_PROMPT_BLOCKS
    return token_ids, block_hashes


def put_prompt(address: str, token_ids: list[int], block_hashes: list[bytes]) -> None:
    """Commit the prompt into T0 once (Put), so that every timed call hits all 256 blocks in T0."""
    packed = pack_token_ids(token_ids)
    stride = 4 * BLOCK_SIZE
    data = bytes(LAYOUT.bytes_per_block)
    blocks = [(h, packed[i * stride:(i + 1) * stride], data) for i, h in enumerate(block_hashes)]
    with KvtierClient(address, max_message_bytes=MAX_MESSAGE_BYTES) as client:
        result = client.put(LAYOUT, blocks)
        assert result.num_blocks == NUM_PROMPT_BLOCKS, result


def check_lookup(answer: ChainLookup) -> None:
    assert answer.total.t0 == NUM_PROMPT_BLOCKS, answer


def check_acquire(acquired) -> None:
    assert acquired.num_t0_hit_blocks == NUM_PROMPT_BLOCKS and not acquired.pending, acquired


def ours_sides(sessions: list[AsyncSession], token_ids: list[int], block_hashes: list[bytes],
               daemon_pid: int) -> dict[str, Side]:
    def lookup_op(i: int) -> Op:
        session = sessions[i]
        return lambda: session.lookup(block_hashes, token_ids=token_ids)

    def acquire_release_op(i: int) -> Op:
        session = sessions[i]
        request_ids = (f"bench-{i}-{n}" for n in itertools.count())

        async def op():
            request_id = next(request_ids)
            acquired = await session.acquire(request_id, block_hashes, token_ids=token_ids)
            await session.release(request_id)
            return acquired
        return op

    return {"lookup": Side("ours", lookup_op, daemon_pid, check_lookup),
            "acquire+release": Side("ours", acquire_release_op, daemon_pid, check_acquire)}


def floor_sides(channel: grpc.aio.Channel, payloads: dict[str, list[bytes]], name: str,
                floor_pid: int) -> dict[str, Side]:
    """One call per payload, in a row: b"" for the floor proper, our requests' bytes for context."""
    call = channel.unary_unary(_grpc_floor.METHOD)  # no (de)serializers: bytes in, bytes out

    def make(requests: list[bytes]) -> Callable[[int], Op]:
        async def op():
            for request in requests:
                await call(request, timeout=CALL_TIMEOUT_S, metadata=())
        return lambda i: op

    return {kind: Side(name, make(requests), floor_pid) for kind, requests in payloads.items()}


def request_bytes(session: AsyncSession, token_ids: list[int], block_hashes: list[bytes]) -> dict[str, list[bytes]]:
    """The serialized requests ours sends per iteration of each kind."""
    tokens = pack_token_ids(token_ids)
    lookup = pb.LookupRequest(session_id=session.session_id, block_hashes=block_hashes, token_ids=tokens)
    acquire = pb.AcquireRequest(session_id=session.session_id, request_id="bench-0-1000000",
                                block_hashes=block_hashes, token_ids=tokens)
    release = pb.ReleaseRequest(session_id=session.session_id, request_id="bench-0-1000000")
    return {"lookup": [lookup.SerializeToString()],
            "acquire+release": [acquire.SerializeToString(), release.SerializeToString()]}


class FloorServer:
    """benchmarks/_grpc_floor.py as a child process, ready once it printed "ready"."""

    def __init__(self, socket_path: str) -> None:
        self.address = "unix://" + socket_path
        self.process = subprocess.Popen(
            [sys.executable, str(Path(_grpc_floor.__file__)), socket_path,
             "--max-message-bytes", str(MAX_MESSAGE_BYTES)], stdout=subprocess.PIPE, text=True)
        line = self.process.stdout.readline().strip()
        if line != "ready":
            self.process.kill()
            raise RuntimeError(f"the floor server did not start (printed {line!r})")

    @property
    def pid(self) -> int:
        return self.process.pid

    def __enter__(self) -> FloorServer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        _report.stop_process(self.process)


async def measure(daemon: DaemonProcess, floor: FloorServer, args, rng) -> list[list[object]]:
    rounds, window_s, warmup_s = (1, 0.3, 0.1) if args.quick else (3, 1.0, 0.3)
    client = AsyncKvtierClient(daemon.unix_address, timeout_s=CALL_TIMEOUT_S, max_message_bytes=MAX_MESSAGE_BYTES)
    channel = grpc.aio.insecure_channel(floor.address, options=channel_options(floor.address, MAX_MESSAGE_BYTES))
    try:
        sessions = [await client.attach(LAYOUT, map_pool=False) for _ in range(max(CONCURRENCIES))]
        token_ids, block_hashes = make_prompt(rng, sessions[0].namespace)
        await asyncio.to_thread(put_prompt, daemon.unix_address, token_ids, block_hashes)
        ours = ours_sides(sessions, token_ids, block_hashes, daemon.pid)
        empty = floor_sides(channel, {"lookup": [b""], "acquire+release": [b"", b""]}, "floor", floor.pid)
        sized = floor_sides(channel, request_bytes(sessions[0], token_ids, block_hashes), "floor + our bytes",
                            floor.pid)
        rows = []
        for kind in ("lookup", "acquire+release"):
            for concurrency in CONCURRENCIES:
                loads = await compare([ours[kind], empty[kind], sized[kind]], concurrency, rounds=rounds,
                                      window_s=window_s, warmup_s=warmup_s)
                rows.append([kind, concurrency, *loads])
        return rows
    finally:
        await client.close()
        await channel.close()


def main(argv: Sequence[str] | None = None) -> int:
    args = _report.parse_args(__doc__.splitlines()[0], argv)
    rng = np.random.default_rng(20240601)
    with tempfile.TemporaryDirectory(prefix="kvtierd-bench-rpc-") as directory:
        daemon_args = small_daemon_args(directory, t0_bytes=T0_BYTES, host_bytes="64MiB", ssd_bytes="64MiB",
                                        extra=["--set", "ssd.directory=",  # T2 off: no disk in the timings
                                               "--set", f"server.max_message_bytes={MAX_MESSAGE_BYTES}"])
        with DaemonProcess(daemon_args) as daemon, FloorServer(os.path.join(directory, "floor.sock")) as floor:
            print_header(args.quick, daemon.pid, floor.pid)
            try:
                import uvloop
                loop_factory = uvloop.new_event_loop
            except ImportError:
                loop_factory = None
            with asyncio.Runner(loop_factory=loop_factory) as runner:
                rows = runner.run(measure(daemon, floor, args, rng))
    print_results(rows)
    return 0


def print_header(quick: bool, daemon_pid: int, floor_pid: int) -> None:
    print(f"Daemon RPCs over a unix socket: Lookup, and Acquire + Release, of a {NUM_PROMPT_TOKENS}-token prompt "
          f"(block {BLOCK_SIZE}, {NUM_PROMPT_BLOCKS} sha256 hashes + token ids), 100% T0 hits")
    print(f"python {platform.python_version()} ({platform.python_implementation()}), {platform.machine()}, "
          f"grpcio {grpc.__version__}, {'QUICK run: rough numbers' if quick else 'full run'}")
    print(f"machine: {os.cpu_count()} CPUs, shared by this client process (one event loop), the daemon "
          f"(pid {daemon_pid}) and the floor server (pid {floor_pid}): latency includes the client's own time")
    print("baseline (floor): benchmarks/_grpc_floor.py, a grpc.aio server set up like the daemon (uvloop, "
          "unix socket, same message limits) answering an empty unary call; for acquire+release, two in a row")
    print("load: 1, 8, 32 concurrent tasks, each looping calls; ours and floor alternate window by window; "
          "gc off while timing; latency per call (acquire+release: per pair of RPCs) by perf_counter_ns")
    print(f"goal: ours p50 <= {GOAL_RATIO:g}x floor p50")
    print()


def print_results(rows: list[list[object]]) -> None:
    table, context, cpu = [], [], []
    for kind, concurrency, ours, floor, sized in rows:
        ratio = ours.percentile_us(0.5) / floor.percentile_us(0.5)
        table.append([kind, concurrency, f"{ours.percentile_us(0.5):,.0f}", f"{ours.percentile_us(0.99):,.0f}",
                      f"{ours.calls_per_s:,.0f}", f"{floor.percentile_us(0.5):,.0f}",
                      f"{floor.percentile_us(0.99):,.0f}", f"{floor.calls_per_s:,.0f}", f"{ratio:.2f}x",
                      f"<= {GOAL_RATIO:g}x", _report.verdict(ratio <= GOAL_RATIO)])
        context.append([kind, concurrency, f"{sized.percentile_us(0.5):,.0f}", f"{sized.percentile_us(0.99):,.0f}",
                        f"{sized.calls_per_s:,.0f}",
                        f"{sized.percentile_us(0.5) / floor.percentile_us(0.5):.2f}x",
                        f"{ours.percentile_us(0.5) / sized.percentile_us(0.5):.2f}x"])
        cpu.append([kind, concurrency, *(f"{load.cpu_us_per_call(cpu_ns):,.0f}" for load in (ours, floor, sized)
                                         for cpu_ns in (load.client_cpu_ns, load.server_cpu_ns))])
    _report.print_table(["rpc", "tasks", "ours p50 us", "p99 us", "calls/s", "floor p50 us", "p99 us", "calls/s",
                         "ratio", "goal", "result"], table)
    print()
    print("ratio = ours p50 / floor p50; calls/s for acquire+release counts pairs")
    print()
    print("context, not judged: the floor sent our requests' bytes (lookup: the LookupRequest; acquire+release:")
    print("the AcquireRequest then the ReleaseRequest) instead of empty ones; the same windows as above")
    _report.print_table(["rpc", "tasks", "p50 us", "p99 us", "calls/s", "/ floor p50", "ours / this p50"], context)
    print()
    print("context, not judged: CPU time per call (acquire+release: per pair), us, of the client (this process,")
    print("all threads) and of the server process (the daemon for ours), over the same windows (/proc, 10 ms ticks)")
    _report.print_table(["rpc", "tasks", "ours client", "daemon", "floor client", "server", "floor+bytes client",
                         "server"], cpu)


if __name__ == "__main__":
    sys.exit(main())
