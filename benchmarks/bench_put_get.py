"""Put and Get of 64 blocks of 2 MiB through a real daemon, beside redis-server SET and GET.

Ours: a real `kvtierd serve` (a child process, kvtierd.launch.daemon_process) on a unix socket;
`KvtierClient.put(llama3_8b(), 64 blocks)` in one Put stream, then `KvtierClient.get` of the 64
hashes (a Get stream of 64 messages). Every round puts a fresh chain (new token ids, so new
hashes), so each Put really writes all 64 blocks. T2 is off (no disk). T0 holds three rounds'
chains and evicts without offloading (`policy.t0_to_t1=off`, so T1 stays out): the warm-up rounds
write every T0 block once, and each timed Put then reuses the blocks of the chain put three
rounds earlier, as a long-running daemon does. (A T0 so large that every round writes blocks
never written before would time the kernel's first-touch page faults of the pool's shared
memory, ~1.2 GB/s here against ~5 GB/s for a plain copy: a start-up cost, not Put's.)

Baseline: a loopback redis-server (Debian's, installed by scripts/install-redis-server into
.tools/bin), on a unix socket with `--save "" --appendonly no`, driven by redis-py: the same 64
values, SET one by one then GET one by one. Extra rows: one pipeline of 64 SETs, one of 64 GETs.
Goal: ours MB/s >= 1x redis' MB/s, Put and Get judged separately.

Untimed between rounds: the previous round is checked (Put wrote 64 fresh blocks; Get and the
redis GETs returned exactly the bytes stored), redis is flushed, and the next chain is hashed.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import _report  # noqa: E402
from kvtierd.block_hash import Namespace  # noqa: E402
from kvtierd.client import KvtierClient  # noqa: E402
from kvtierd.launch.daemon_process import DaemonProcess, small_daemon_args  # noqa: E402
from kvtierd.layout import llama3_8b  # noqa: E402
from kvtierd.token_bytes import pack_token_ids  # noqa: E402

LAYOUT = llama3_8b()  # 2 MiB a block, 16 tokens
NUM_BLOCKS = 64
BLOCK_BYTES = LAYOUT.bytes_per_block
TOTAL_BYTES = NUM_BLOCKS * BLOCK_BYTES  # 128 MiB a round
MAX_MESSAGE_BYTES = 16 << 20  # the daemon's default; a message carries one 2 MiB block
CALL_TIMEOUT_S = 120.0
VOCAB_SIZE = 128_256  # Llama 3
GOAL_RATIO = 1.0
T0_ROUNDS = 3  # T0 holds this many rounds' chains; as many warm-up rounds write all of it once
INSTALL_HINT = "run scripts/install-redis-server (it puts redis-server into .tools/bin/)"


def redis_server_binary() -> str | None:
    """.tools/bin/redis-server (scripts/install-redis-server), else one on PATH."""
    local = ROOT / ".tools" / "bin" / "redis-server"
    if os.access(local, os.X_OK):
        return str(local)
    return shutil.which("redis-server")


class RedisServer:
    """redis-server on a unix socket in `directory`, no persistence; stopped on exit."""

    def __init__(self, binary: str, directory: str) -> None:
        import redis

        self.socket_path = os.path.join(directory, "redis.sock")
        self.process = subprocess.Popen(
            [binary, "--port", "0", "--unixsocket", self.socket_path, "--unixsocketperm", "700", "--save", "",
             "--appendonly", "no", "--dir", directory, "--daemonize", "no", "--loglevel", "warning"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.client = redis.Redis(unix_socket_path=self.socket_path, socket_timeout=CALL_TIMEOUT_S)
        deadline = time.monotonic() + 20
        while True:
            try:
                self.client.ping()
                break
            except redis.exceptions.ConnectionError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"redis-server did not start:\n{self.process.stdout.read()}") from None
                time.sleep(0.05)
        self.version = self.client.info("server")["redis_version"]

    def stop(self) -> None:
        self.client.close()
        _report.stop_process(self.process)

    def __enter__(self) -> RedisServer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


@dataclasses.dataclass(slots=True)
class Chain:
    """One round's blocks: hashes, packed tokens per block, and the fixed 64 values."""

    hashes: list[bytes]
    tokens: list[bytes]


class Rounds:
    """Our ops and redis' ops over the same values; `setup` checks a round and starts the next."""

    def __init__(self, client: KvtierClient, redis_client, values: list[bytes], rng: np.random.Generator) -> None:
        self.client = client
        self.redis = redis_client
        self.values = values
        self.rng = rng
        self.namespace = Namespace(LAYOUT, tenant="", algo="sha256")  # the client's hashing (SessionBase)
        self.chain: Chain | None = None
        self.results: dict[str, object] = {}
        self.num_rounds = 0

    def new_chain(self) -> Chain:
        token_array = self.rng.integers(0, VOCAB_SIZE, NUM_BLOCKS * LAYOUT.block_size, dtype=np.uint32)
        packed = pack_token_ids(token_array)
        stride = 4 * LAYOUT.block_size
        return Chain(hashes=self.namespace.hash_blocks(token_array.tolist()),
                     tokens=[packed[i * stride:(i + 1) * stride] for i in range(NUM_BLOCKS)])

    def setup(self) -> None:
        if self.chain is not None:
            self.check()
        self.results.clear()
        self.redis.flushall()
        self.chain = self.new_chain()

    def check(self) -> None:
        put = self.results.pop("ours put")
        assert put.num_blocks == NUM_BLOCKS and put.num_already_cached_blocks == 0, put
        got = self.results.pop("ours get")
        assert [h for h, _ in got] == self.chain.hashes, "Get returned other blocks"
        assert all(data == value for (_, data), value in zip(got, self.values)), "Get returned other bytes"
        for name in ("redis get", "redis pipelined get"):
            assert self.results.pop(name) == self.values, name
        self.num_rounds += 1

    # ----------------------------------------------------------------------------- ours

    def ours_put(self) -> None:
        chain = self.chain
        self.results["ours put"] = self.client.put(LAYOUT, list(zip(chain.hashes, chain.tokens, self.values)))

    def ours_get(self) -> None:
        self.results["ours get"] = self.client.get(LAYOUT, self.chain.hashes)

    # ----------------------------------------------------------------------------- redis

    def redis_set(self) -> None:
        for key, value in zip(self.chain.hashes, self.values):
            self.redis.set(key, value)

    def redis_get(self) -> None:
        self.results["redis get"] = [self.redis.get(key) for key in self.chain.hashes]

    def redis_pipelined_set(self) -> None:
        pipeline = self.redis.pipeline(transaction=False)
        for key, value in zip(self.chain.hashes, self.values):
            pipeline.set(b"p" + key, value)
        pipeline.execute()

    def redis_pipelined_get(self) -> None:
        pipeline = self.redis.pipeline(transaction=False)
        for key in self.chain.hashes:
            pipeline.get(b"p" + key)
        self.results["redis pipelined get"] = pipeline.execute()


def mb_per_s(ns: float) -> float:
    return TOTAL_BYTES / (ns / 1e9) / 1e6


def main(argv: Sequence[str] | None = None) -> int:
    args = _report.parse_args(__doc__.splitlines()[0], argv)
    rounds, warmup = (2, T0_ROUNDS) if args.quick else (10, T0_ROUNDS)
    binary = redis_server_binary()
    if binary is None:
        print(f"bench_put_get: no redis-server for the baseline; {INSTALL_HINT}", file=sys.stderr)
        return 2
    import redis

    rng = np.random.default_rng(20240601)
    values = [rng.bytes(BLOCK_BYTES) for _ in range(NUM_BLOCKS)]
    with tempfile.TemporaryDirectory(prefix="kvtierd-bench-putget-") as directory:
        daemon_args = small_daemon_args(directory, t0_bytes=str(T0_ROUNDS * TOTAL_BYTES), host_bytes="64MiB",
                                        ssd_bytes="64MiB",
                                        extra=["--set", "ssd.directory=",  # T2 off: no disk in the timings
                                               "--set", "policy.t0_to_t1=off",  # evict without offloading
                                               "--set", f"server.max_message_bytes={MAX_MESSAGE_BYTES}"])
        with DaemonProcess(daemon_args) as daemon, RedisServer(binary, directory) as redis_server, \
                KvtierClient(daemon.unix_address, timeout_s=CALL_TIMEOUT_S,
                             max_message_bytes=MAX_MESSAGE_BYTES) as client:
            t0_line = next((line.strip() for line in daemon.lines if line.startswith("T0 pool:")), "T0 pool: ?")
            print_header(args.quick, t0_line, redis_server.version, redis, binary, rounds, warmup)
            state = Rounds(client, redis_server.client, values, rng)
            timings = _report.time_interleaved(
                [state.ours_put, state.redis_set, state.redis_pipelined_set,
                 state.ours_get, state.redis_get, state.redis_pipelined_get],
                rounds=rounds, warmup=warmup, setup=state.setup)
            assert state.num_rounds == rounds + warmup, state.num_rounds
    ours_put, redis_set, redis_pipelined_set, ours_get, redis_get, redis_pipelined_get = timings
    rows = [row("Put (one Put stream) vs 64 SETs", ours_put, redis_set),
            row("Get (one Get stream) vs 64 GETs", ours_get, redis_get),
            row("[extra] Put vs one pipeline of 64 SETs", ours_put, redis_pipelined_set),
            row("[extra] Get vs one pipeline of 64 GETs", ours_get, redis_pipelined_get)]
    _report.print_table(["case", "ours MB/s", "redis MB/s", "ratio", "(best)", "goal", "result"], rows)
    print()
    print(f"MB/s = {TOTAL_BYTES:,} bytes / time (MB = 10^6 bytes); ratio = ours MB/s / redis MB/s, on the medians")
    return 0


def row(name: str, ours: _report.Timings, baseline: _report.Timings) -> list[str]:
    ratio = baseline.median_ns / ours.median_ns
    return [name, _report.median_and_best(mb_per_s(ours.median_ns), mb_per_s(ours.best_ns)),
            _report.median_and_best(mb_per_s(baseline.median_ns), mb_per_s(baseline.best_ns)),
            f"{ratio:.2f}x", f"{baseline.best_ns / ours.best_ns:.2f}x", f">= {GOAL_RATIO:g}x",
            _report.verdict(ratio >= GOAL_RATIO)]


def print_header(quick: bool, t0_line: str, redis_version: str, redis_module, binary: str, rounds: int,
                 warmup: int) -> None:
    import torch

    _report.print_header(f"Put / Get of {NUM_BLOCKS} x {BLOCK_BYTES // 2**20} MiB blocks ({LAYOUT.model_id}, block "
                         f"{LAYOUT.block_size}) over a unix socket, beside redis-server", quick)
    print(f"machine: {os.cpu_count()} CPUs, shared by this client process, the daemon and redis-server")
    print(f"ours: kvtierd serve, {t0_line} ({'CUDA' if torch.cuda.is_available() else 'no CUDA: T0 in host memory'}),"
          f" T2 off; T0 holds {T0_ROUNDS} rounds and evicts without offload (policy.t0_to_t1=off), every block "
          f"written once in the warm-up; KvtierClient (blocking grpc), max message {MAX_MESSAGE_BYTES >> 20} MiB")
    parser = getattr(getattr(redis_module.connection, "DefaultParser", None), "__name__", "?")
    print(f"baseline: redis-server {redis_version} ({binary}), unix socket, --save '' --appendonly no; "
          f"redis-py {redis_module.__version__} ({parser})")
    print(f"goal: ours >= {GOAL_RATIO:g}x redis MB/s; {rounds} rounds after {warmup} warm-up rounds, a fresh chain "
          f"each round")
    print()


if __name__ == "__main__":
    sys.exit(main())
