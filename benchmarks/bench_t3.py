"""T3, the shared store, end to end: Put / Get of 64 x 2 MiB, promotion of a prefix, TTFT of a T3 hit, Lookup.

One run, one loopback Redis Cluster (scripts/redis_cluster.py: 3 masters of Debian's redis-server on free
127.0.0.1 ports, --save "" --appendonly no, maxmemory 1 GB each, allkeys-lru), started and stopped by this
script; every daemon is a real `kvtierd serve` (kvtierd.launch.daemon_process) on a unix socket, T2 off.
A daemon "with T3" has `remote.endpoints` = the cluster's masters and `policy.t0_to_t1 = write_through`
(so T1 writes through into T3 at once), as in tests/t3/test_two_nodes.py. Node A and node B are two
such daemons (own sockets and pools); no byte goes from A to B except through the cluster.

1. Put / Get of 64 blocks of 2 MiB (Llama-3-8B), a fresh chain every round, the cluster flushed between
   rounds. Ours, Put: `KvtierClient.put` on node A, timed until T3 holds all 64 (the Put RPC, then Stats
   polled every 10 ms until pools[].t3.num_written_blocks grew by 64). Ours, Get: `KvtierClient.get` on
   node B, which holds nothing of the chain: T3 -> T1 -> T0 -> the wire; the bytes are checked.
   Baseline: the same 64 values SET, then GET, on the same cluster by plain redis-py: the keys grouped by
   slot owner, one pipeline per master, the 3 run at once on 3 threads (benchmarks/bench_redis_clients.py
   found per-node pipelines the fastest); three client settings: hiredis (redis-py's default, the
   daemon's), hiredis parsing with commands packed in Python, and pure-Python RESP. Judged against the
   best of the three in this run, per op. Goal: ours MB/s >= 0.8x baseline MB/s, Put and Get.
   Context row per op: the CPU time every process spent on it (this client, both daemons, the three
   redis-servers; /proc), ours beside the judged baseline's: where the cores are saturated, ours cannot
   run faster than that ratio of the baseline.
2. TTFT on node B of a 2,048-token prefix computed on node A: the reference runner (connectors/reference)
   on the random-weight Llama of bench_ttft.py (8 layers, hidden 1024, 160 M parameters, fp32 on CPU).
   Each round a fresh random prefix: node A's runner computes prefix + 64 tokens and commits it (write
   through to T3; untimed, waited for), then the baseline (the same prompt recomputed on a private pool,
   no kvtierd) and node B's runner run prefix + 64 other tokens: every prefix block must come from T3 and
   the first token must be the baseline's. Goal: a T3 hit >= 5x faster than recompute.
3. Lookup of a 4,096-token prefix (block 16, 256 sha256 hashes + token ids; a 4 KiB-a-block layout), as
   bench_daemon_rpc.py times it (AsyncKvtierClient, one task looping calls in windows, the sides
   alternating window by window, p50): a daemon with T3 (node B) beside one without; the prefix (a) not
   local but in T3 (put through node A: the T3 probe runs, the chain's first and last keys asked),
   (b) all in T0 (put into both daemons: T3 not asked). Context row: (c) in no tier (the probe finds
   nothing). Goal: with T3 p50 <= 1.5x without, (a) and (b).

4. Promotion of a 4,096-token prefix held only in T3, the path an engine takes (a 512 KiB-a-block
   layout, 16 layers x 8 KV heads x 64 fp16: 256 blocks, 128 MiB): each round node A puts a fresh prefix
   until T3 holds it; node C, which holds nothing of it, runs Acquire + Wait + Release (timed; every block
   must be ready); the baseline GETs the very values node C reads (the keys found in the cluster) with
   plain redis-py per-node pipelines (hiredis). MB/s = the values' bytes / time. Goal: ours >= 0.8x.

5. Sealed beside clear ([encryption] on / off), the reads of T3 blocks: two pairs of daemons, each pair on
   its own key prefix in the same cluster, the same but for [encryption] (both with T2 configured, as
   encryption needs, and policy.t1_to_t2 = off, so no disk in the way). Each round a fresh chain of
   `--blocks` x 2 MiB and a second one are put through each pair's node A until its T3 holds them; then
   node B of each pair, which holds nothing of them, Gets the first (T3 -> the wire, bytes checked) and
   promotes the second as an engine does (Acquire + Wait + Release into T0), the four ops alternating.
   Sealed, every value read is opened (AES-256-GCM) and its tenant's key record read beside it. Ratio =
   clear time / sealed time (sealed MB/s over clear MB/s). Goal: >= 0.9x, Get and promotion.

`--profile DIR`: after the timed rounds, py-spy records node A during 10 more Puts, node B during 10 more
Gets and during 5 s of Lookups of the chain in T3 (raw collapsed stacks in DIR); the top frames are printed
after the tables. `--parts` runs some of the five parts only.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import _report, bench_daemon_rpc  # noqa: E402
from benchmarks._profile import py_spy, stop_py_spy, summarize_profile  # noqa: E402
from benchmarks.bench_redis_clients import connection_class  # noqa: E402
from benchmarks.bench_ttft import FULL, QUICK  # noqa: E402
from kvtierd.block_hash import Namespace  # noqa: E402
from kvtierd.client import AsyncKvtierClient, KvtierClient  # noqa: E402
from kvtierd.connectors.reference.kv_backend import PrivateKv, num_blocks_for  # noqa: E402
from kvtierd.connectors.reference.llama_model import LlamaModel  # noqa: E402
from kvtierd.connectors.reference.llama_weights import random_weights  # noqa: E402
from kvtierd.connectors.reference.runner import GenerationRequest, ReferenceRunner  # noqa: E402
from kvtierd.connectors.reference.runner_connector import KvtierdConnector  # noqa: E402
from kvtierd.launch.daemon_process import ONE_LAYOUT, DaemonProcess, small_daemon_args  # noqa: E402
from kvtierd.layout import Layout, llama3_8b  # noqa: E402
from kvtierd.token_bytes import pack_token_ids  # noqa: E402
from scripts import redis_cluster  # noqa: E402

LAYOUT = llama3_8b()  # 2 MiB a block, 16 tokens
BLOCK_BYTES = LAYOUT.bytes_per_block
LOOKUP_LAYOUT = Layout("bench-t3-lookup", num_layers=2, num_kv_heads=2, head_dim=16, block_size=16)  # 4 KiB
BLOCK_SIZE = 16
NUM_NEW_TOKENS = 64
VOCAB_SIZE = 128_256  # Llama 3
MAX_MESSAGE_BYTES = 16 << 20
CALL_TIMEOUT_S = 120.0
MAXMEMORY = "1gb"  # per master; the cluster is flushed between rounds
POLL_S = 0.01  # Stats polled this often while waiting for T3 writes (a Stats costs the daemon ~0.4 ms of CPU)
T3_WAIT_S = 60.0
GOAL_PUT_GET, GOAL_TTFT, GOAL_LOOKUP, GOAL_SEALED = 0.8, 5.0, 1.5, 0.9
MASTER_KEY_HEX = "3c" * 32  # the sealed pair's master key (a benchmark's, not a secret)
PROFILES: list[str] = []  # --profile: the summaries, printed after the tables
BASELINE_CLIENTS = {"hiredis": "hiredis (redis-py's default; the daemon's)",
                    "hiredis-parser": "hiredis parser, Python packer", "python": "pure-Python RESP"}


# --------------------------------------------------------------------------------------------- nodes

def node_args(directory: str, name: str, seeds: str | None, t0_bytes: int, host_bytes: int) -> list[str]:
    """A daemon in directory/name, T2 off; with T3 on `seeds` (write-through T0 -> T1 -> T3) when given."""
    path = os.path.join(directory, name)
    os.makedirs(path, exist_ok=True)
    extra = ["--set", "ssd.directory=", "--set", f"server.max_message_bytes={MAX_MESSAGE_BYTES}", *ONE_LAYOUT]
    if seeds:
        extra += ["--set", f"remote.endpoints={seeds}", "--set", "policy.t0_to_t1=write_through"]
    return small_daemon_args(path, t0_bytes=str(t0_bytes), host_bytes=str(host_bytes), ssd_bytes="64MiB",
                             extra=extra)


def t3_stats(client: KvtierClient, model_id: str):
    pools = [p for p in client.stats().pools if p.layout.model_id == model_id]
    return pools[0].t3 if pools and pools[0].HasField("t3") else None


def t3_written(client: KvtierClient, model_id: str) -> int:
    stats = t3_stats(client, model_id)
    return stats.num_written_blocks if stats is not None else 0


def wait_t3_written(client: KvtierClient, model_id: str, target: int) -> None:
    """Until the daemon's T3 wrote `target` blocks of the layout (Stats polled every POLL_S)."""
    deadline = time.monotonic() + T3_WAIT_S
    while True:
        stats = t3_stats(client, model_id)
        if stats is not None and stats.num_written_blocks >= target:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"T3 did not take the blocks within {T3_WAIT_S:g} s: {stats}")
        time.sleep(POLL_S)


def flush(cluster: redis_cluster.LocalRedis) -> None:
    for port in cluster.ports:
        with contextlib.closing(cluster.node_client(port)) as client:
            client.flushall()


def random_tokens(rng: np.random.Generator, num_tokens: int, vocab_size: int = VOCAB_SIZE) -> list[int]:
    return rng.integers(1, vocab_size, num_tokens).tolist()


# --------------------------------------------------------------------------------------------- 1. Put / Get

class NodePipelines:
    """The baseline: one redis.Redis per master (`parser` as in BASELINE_CLIENTS), keys grouped by the
    master that owns their slot, one pipeline per master, the pipelines run at once on threads."""

    def __init__(self, cluster: redis_cluster.LocalRedis, parser: str, threads: ThreadPoolExecutor) -> None:
        import redis

        self.cluster, self.threads = cluster, threads
        options = dict(host=redis_cluster.HOST, socket_timeout=CALL_TIMEOUT_S, socket_read_size=1 << 20)
        if parser != "hiredis":
            options["connection_class"] = connection_class(hiredis_parser=parser == "hiredis-parser")
        self.clients = {port: redis.Redis(connection_pool=redis.ConnectionPool(port=port, **options))
                        for port in cluster.ports}

    def _on_nodes(self, keys: list[bytes], queue) -> list:
        groups: dict[int, list[int]] = collections.defaultdict(list)
        for i, key in enumerate(keys):
            groups[self.cluster.key_owner(key)].append(i)

        def run(port: int, positions: list[int]):
            pipeline = self.clients[port].pipeline(transaction=False)
            for i in positions:
                queue(pipeline, i)
            return positions, pipeline.execute()

        replies: list = [None] * len(keys)
        for positions, results in [f.result() for f in [self.threads.submit(run, port, positions)
                                                         for port, positions in groups.items()]]:
            for i, result in zip(positions, results):
                replies[i] = result
        return replies

    def set(self, keys: list[bytes], values: list[bytes]) -> None:
        assert all(self._on_nodes(keys, lambda pipeline, i: pipeline.set(keys[i], values[i])))

    def get(self, keys: list[bytes]) -> list:
        return self._on_nodes(keys, lambda pipeline, i: pipeline.get(keys[i]))

    def close(self) -> None:
        for client in self.clients.values():
            client.close()


class PutGetRounds:
    """Ours (Put on A until T3 holds it, Get on B) and the baselines over the same values; `setup`
    checks the round before, flushes the cluster and makes the next chain."""

    def __init__(self, cluster, on_a: KvtierClient, on_b: KvtierClient, baselines: dict[str, NodePipelines],
                 num_blocks: int, rng: np.random.Generator) -> None:
        self.cluster, self.on_a, self.on_b, self.baselines = cluster, on_a, on_b, baselines
        self.num_blocks, self.rng = num_blocks, rng
        self.values = [rng.bytes(BLOCK_BYTES) for _ in range(num_blocks)]
        self.namespace = Namespace(LAYOUT, tenant="", algo="sha256")  # the client's hashing (SessionBase)
        self.hashes: list[bytes] = []
        self.tokens: list[int] = []
        self.results: dict[str, object] = {}
        self.num_rounds = 0
        self.put_rpc_ns: list[int] = []  # the Put RPC alone, every round (warm-up included)

    def setup(self) -> None:
        if self.hashes:
            self.check()
        self.fresh()

    def fresh(self) -> None:
        self.results.clear()
        flush(self.cluster)
        self.tokens = random_tokens(self.rng, self.num_blocks * BLOCK_SIZE)
        self.hashes = self.namespace.hash_blocks(self.tokens)
        self.keys = {name: [b"%s:%s" % (name.encode(), h.hex().encode()) for h in self.hashes]
                     for name in self.baselines}
        self.t3_before = t3_written(self.on_a, LAYOUT.model_id)

    def check(self) -> None:
        put = self.results.pop("put")
        assert put.num_blocks == self.num_blocks and put.num_already_cached_blocks == 0, put
        got = self.results.pop("get")
        assert [h for h, _ in got] == self.hashes, f"Get on node B returned {len(got)} of {self.num_blocks} blocks"
        assert all(data == value for (_, data), value in zip(got, self.values)), "Get returned other bytes"
        for name in self.baselines:
            assert self.results.pop(name) == self.values, f"{name} GET returned other bytes"
        stats = t3_stats(self.on_a, LAYOUT.model_id)
        assert stats.num_failed_writes == 0 and stats.num_dropped_writes == 0, stats
        self.num_rounds += 1

    def ours_put(self) -> None:
        packed, stride = pack_token_ids(self.tokens), 4 * BLOCK_SIZE
        blocks = [(h, packed[i * stride:(i + 1) * stride], v) for i, (h, v) in enumerate(zip(self.hashes, self.values))]
        start = time.perf_counter_ns()
        self.results["put"] = self.on_a.put(LAYOUT, blocks)
        self.put_rpc_ns.append(time.perf_counter_ns() - start)
        wait_t3_written(self.on_a, LAYOUT.model_id, self.t3_before + self.num_blocks)

    def ours_get(self) -> None:
        self.results["get"] = self.on_b.get(LAYOUT, self.hashes, token_ids=self.tokens)

    def baseline_set(self, name: str):
        return lambda: self.baselines[name].set(self.keys[name], self.values)

    def baseline_get(self, name: str):
        return lambda: self.results.__setitem__(name, self.baselines[name].get(self.keys[name]))


def bench_put_get(cluster, directory: str, args, rng) -> tuple[list[list[str]], list[str]]:
    round_bytes = args.blocks * BLOCK_BYTES
    pool_bytes = 2 * round_bytes + 16 * BLOCK_BYTES  # T0 and T1 hold two rounds: the warm-up touches every slot
    with DaemonProcess(node_args(directory, "put-get-a", cluster.seeds, pool_bytes, pool_bytes)) as a, \
            DaemonProcess(node_args(directory, "put-get-b", cluster.seeds, pool_bytes, pool_bytes)) as b, \
            KvtierClient(a.address, timeout_s=CALL_TIMEOUT_S, max_message_bytes=MAX_MESSAGE_BYTES) as on_a, \
            KvtierClient(b.address, timeout_s=CALL_TIMEOUT_S, max_message_bytes=MAX_MESSAGE_BYTES) as on_b, \
            ThreadPoolExecutor(len(cluster.ports), thread_name_prefix="node-pipeline") as threads, \
            contextlib.ExitStack() as stack:
        baselines = {}
        for name in BASELINE_CLIENTS:
            baselines[name] = NodePipelines(cluster, name, threads)
            stack.callback(baselines[name].close)
        state = PutGetRounds(cluster, on_a, on_b, baselines, args.blocks, rng)
        ops = ([state.ours_put] + [state.baseline_set(n) for n in baselines]
               + [state.ours_get] + [state.baseline_get(n) for n in baselines])
        machine_cpu = MachineCpu([a.pid, b.pid, *(node.pid for node in cluster.nodes.values())])
        timings = _report.time_interleaved([machine_cpu.counted(op) for op in ops], rounds=args.rounds,
                                           warmup=args.warmup, setup=state.setup)
        assert state.num_rounds == args.rounds + args.warmup, state.num_rounds
        notes = [line.strip() for line in a.lines if line.startswith(("T0 pool:", "T3 shared store:"))]
        if args.profile:
            PROFILES.extend(profile_put_get(state, a.pid, b.pid, Path(args.profile)))
    num = len(baselines)
    put, sets, get, gets = timings[0], timings[1:1 + num], timings[1 + num], timings[2 + num:]
    mb_per_s = lambda ns: round_bytes / (ns / 1e9) / 1e6  # noqa: E731
    rows = []
    cpu_ms = [statistics.median(machine_cpu.ns[op][-args.rounds:]) / 1e6 for op in ops]  # per op, per round
    put_cpu, set_cpus, get_cpu, get_cpus = cpu_ms[0], cpu_ms[1:1 + num], cpu_ms[1 + num], cpu_ms[2 + num:]
    for case, ours, baseline_timings, ours_cpu, baseline_cpus in (
            ("Put on A until T3 holds it / SET", put, sets, put_cpu, set_cpus),
            ("Get on B from T3 / GET", get, gets, get_cpu, get_cpus)):
        best_name, best, best_cpu = min(zip(baselines, baseline_timings, baseline_cpus),
                                        key=lambda item: item[1].median_ns)
        ratio = best.median_ns / ours.median_ns
        rows.append([f"{case} ({best_name})", _report.median_and_best(mb_per_s(ours.median_ns), mb_per_s(ours.best_ns)),
                     _report.median_and_best(mb_per_s(best.median_ns), mb_per_s(best.best_ns)), f"{ratio:.2f}x",
                     f">= {GOAL_PUT_GET:g}x", _report.verdict(ratio >= GOAL_PUT_GET)])
        for name, timing in zip(baselines, baseline_timings):
            rows.append([f"  [baseline] {BASELINE_CLIENTS[name]}", "",
                         _report.median_and_best(mb_per_s(timing.median_ns), mb_per_s(timing.best_ns)),
                         f"{timing.median_ns / ours.median_ns:.2f}x", "", ""])
        rows.append([f"  [context] CPU ms a round, all processes: ours {ours_cpu:,.0f}, {best_name} {best_cpu:,.0f} "
                     "(the ratio: ours' ceiling on saturated cores)", "", "", f"{best_cpu / ours_cpu:.2f}x", "", ""])
        if ours is put:
            rpc = _report.Timings(state.put_rpc_ns[args.warmup:args.warmup + args.rounds])
            rows.append(["  [context] the Put RPC alone (into T0; T3 writes not waited for)",
                         _report.median_and_best(mb_per_s(rpc.median_ns), mb_per_s(rpc.best_ns)), "",
                         f"{best.median_ns / rpc.median_ns:.2f}x", "", ""])
    return rows, notes


class MachineCpu:
    """User + system CPU time that each op costs the whole machine: this client process (all its
    threads) and the given processes (the daemons, the redis-servers), read from /proc around it."""

    def __init__(self, pids: Sequence[int]) -> None:
        self.pids = list(pids)
        self.ns: dict[object, list[int]] = collections.defaultdict(list)  # op -> CPU ns, a sample per call

    def now_ns(self) -> int:
        return time.process_time_ns() + sum(bench_daemon_rpc.process_cpu_ns(pid) for pid in self.pids)

    def counted(self, op):
        def run() -> None:
            start = self.now_ns()
            op()
            self.ns[op].append(self.now_ns() - start)
        return run


# --------------------------------------------------------------------------------------------- profile

def profile_put_get(state: PutGetRounds, a_pid: int, b_pid: int, directory: Path) -> list[str]:
    """py-spy on node A during 10 Puts, then on node B during 10 Gets (each after its Put); top frames."""
    lines = []
    for name, pid, ops in (("put-node-a", a_pid, [state.ours_put]),
                           ("get-node-b", b_pid, [state.ours_put, state.ours_get])):
        output = directory / f"{name}.txt"
        recorder = py_spy(pid, output)
        try:
            for _ in range(10):
                state.fresh()
                for op in ops:
                    op()
        finally:
            stop_py_spy(recorder)
        lines += summarize_profile(name, output)
    return lines


# --------------------------------------------------------------------------------------------- 2. TTFT

def bench_ttft(cluster, directory: str, args, rng) -> list[list[str]]:
    config = QUICK if args.quick else FULL
    model = LlamaModel(config, random_weights(config, seed=0))
    layout = config.layout("bench-t3-ttft", BLOCK_SIZE)
    num_request_blocks = num_blocks_for(args.prefix_tokens + NUM_NEW_TOKENS + 1, BLOCK_SIZE)
    pool_bytes = 3 * num_request_blocks * layout.bytes_per_block
    private = ReferenceRunner(model, PrivateKv(layout, num_request_blocks, model.device))
    ttft = collections.defaultdict(list)
    flush(cluster)
    with DaemonProcess(node_args(directory, "ttft-a", cluster.seeds, pool_bytes, 2 * pool_bytes)) as a, \
            DaemonProcess(node_args(directory, "ttft-b", cluster.seeds, pool_bytes, 2 * pool_bytes)) as b, \
            KvtierClient(a.address, timeout_s=CALL_TIMEOUT_S) as on_a, \
            KvtierClient(b.address, timeout_s=CALL_TIMEOUT_S) as on_b:
        runner_a = ReferenceRunner(model, KvtierdConnector(on_a.attach(layout)))
        runner_b = ReferenceRunner(model, KvtierdConnector(on_b.attach(layout)))
        for round_ in range(args.ttft_rounds):
            prefix = random_tokens(rng, args.prefix_tokens, config.vocab_size)
            prompt_a = prefix + random_tokens(rng, NUM_NEW_TOKENS, config.vocab_size)
            prompt_b = prefix + random_tokens(rng, NUM_NEW_TOKENS, config.vocab_size)
            before = t3_written(on_a, layout.model_id)
            on_node_a = runner_a.generate([GenerationRequest(f"a{round_}", prompt_a, max_new_tokens=1)])[0]
            assert on_node_a.num_hit_tokens == 0, on_node_a
            wait_t3_written(on_a, layout.model_id, before + len(prompt_a) // BLOCK_SIZE)
            request = GenerationRequest(f"b{round_}", prompt_b, max_new_tokens=1)
            baseline = private.generate([request])[0]
            ours = runner_b.generate([request])[0]
            hits = (ours.num_t0_hit_tokens, ours.num_t1_hit_tokens, ours.num_t2_hit_tokens, ours.num_t3_hit_tokens)
            assert hits == (0, 0, 0, args.prefix_tokens // BLOCK_SIZE * BLOCK_SIZE), hits
            assert ours.output_token_ids == baseline.output_token_ids, "node B's first token differs from recompute"
            ttft["recompute"].append(baseline.ttft_s)
            ttft["ours"].append(ours.ttft_s)
            ttft["node A"].append(on_node_a.ttft_s)
    med = {k: statistics.median(v) * 1e3 for k, v in ttft.items()}
    best = {k: min(v) * 1e3 for k, v in ttft.items()}
    speedup = med["recompute"] / med["ours"]
    name = (f"{args.prefix_tokens}-token prefix + {NUM_NEW_TOKENS} new: T3 hit on B (computed on A) / recompute "
            f"({config.num_hidden_layers} layers, hidden {config.hidden_size}, "
            f"{config.num_parameters() / 1e6:.0f} M, fp32 CPU)")
    return [[name, _report.median_and_best(med["ours"], best["ours"], 1),
             _report.median_and_best(med["recompute"], best["recompute"], 1), f"{speedup:.2f}x",
             f">= {GOAL_TTFT:g}x faster", _report.verdict(speedup >= GOAL_TTFT)],
            ["  [context] node A's own cold TTFT through kvtierd (a miss; commits, writes through)",
             _report.median_and_best(med["node A"], best["node A"], 1), "", f"{med['recompute'] / med['node A']:.2f}x",
             "", ""]]


# --------------------------------------------------------------------------------------------- 3. Lookup

async def lookup_loads(addresses: Sequence[str], pids: Sequence[int], args, rng) -> dict[str, list]:
    """Loads of the Lookup sides: (node A, node B with T3, node C without) at `addresses`."""
    on_a_address, with_t3, without_t3 = addresses
    clients = [AsyncKvtierClient(address, timeout_s=5.0) for address in (on_a_address, with_t3, without_t3)]
    try:
        node_a, node_b, node_c = [await client.attach(LOOKUP_LAYOUT, map_pool=False) for client in clients]
        num_blocks = args.lookup_tokens // BLOCK_SIZE
        chains = {}
        for case in ("t3", "t0", "none"):
            tokens = random_tokens(rng, args.lookup_tokens)
            chains[case] = (tokens, node_a.namespace.hash_blocks(tokens))

        def put(address: str, case: str) -> None:
            tokens, hashes = chains[case]
            packed, stride, data = pack_token_ids(tokens), 4 * BLOCK_SIZE, bytes(LOOKUP_LAYOUT.bytes_per_block)
            with KvtierClient(address) as client:
                before = t3_written(client, LOOKUP_LAYOUT.model_id)
                blocks = [(h, packed[i * stride:(i + 1) * stride], data) for i, h in enumerate(hashes)]
                assert client.put(LOOKUP_LAYOUT, blocks).num_blocks == num_blocks
                if address == on_a_address:
                    wait_t3_written(client, LOOKUP_LAYOUT.model_id, before + num_blocks)

        for address, case in ((on_a_address, "t3"), (with_t3, "t0"), (without_t3, "t0")):
            await asyncio.to_thread(put, address, case)

        def side(session, case: str, want: tuple[int, int], pid: int) -> bench_daemon_rpc.Side:
            tokens, hashes = chains[case]

            def check(response) -> None:
                assert (response.total.t0, response.total.t3) == want, response
            return bench_daemon_rpc.Side(case, lambda i: lambda: session.lookup(hashes, token_ids=tokens), pid, check)

        sides = {"t3 with": side(node_b, "t3", (0, num_blocks), pids[1]),
                 "t3 without": side(node_c, "t3", (0, 0), pids[2]),
                 "t0 with": side(node_b, "t0", (num_blocks, 0), pids[1]),
                 "t0 without": side(node_c, "t0", (num_blocks, 0), pids[2]),
                 "none with": side(node_b, "none", (0, 0), pids[1]),
                 "none without": side(node_c, "none", (0, 0), pids[2])}
        loads = await bench_daemon_rpc.compare(list(sides.values()), 1, rounds=args.lookup_rounds,
                                               window_s=args.window_s, warmup_s=args.window_s / 3)
        if args.profile:  # node B during 5 s of Lookups of the chain in T3
            output = Path(args.profile) / "lookup-node-b.txt"
            recorder = py_spy(pids[1], output)
            try:
                side_ = sides["t3 with"]
                await bench_daemon_rpc.run_window([side_.make_op(0)], 5.0, side_.check, None)
            finally:
                stop_py_spy(recorder)
            PROFILES.extend(summarize_profile("lookup-node-b", output))
        return dict(zip(sides, loads))
    finally:
        for client in clients:
            await client.close()


def bench_lookup(cluster, directory: str, args, rng) -> list[list[str]]:
    flush(cluster)
    pool_bytes = 64 << 20
    with DaemonProcess(node_args(directory, "lookup-a", cluster.seeds, pool_bytes, pool_bytes)) as a, \
            DaemonProcess(node_args(directory, "lookup-b", cluster.seeds, pool_bytes, pool_bytes)) as b, \
            DaemonProcess(node_args(directory, "lookup-c", None, pool_bytes, pool_bytes)) as c:
        try:
            import uvloop
            loop_factory = uvloop.new_event_loop
        except ImportError:
            loop_factory = None
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            loads = runner.run(lookup_loads([d.address for d in (a, b, c)], [d.pid for d in (a, b, c)], args, rng))
    rows = []
    for case, name, judged in (("t3", "not local, in T3 (the T3 probe runs)", True),
                               ("t0", "all in T0 (T3 not asked)", True),
                               ("none", "[context] in no tier (the probe finds nothing)", False)):
        ours, without = loads[f"{case} with"], loads[f"{case} without"]
        ratio = ours.percentile_us(0.5) / without.percentile_us(0.5)
        rows.append([f"Lookup {args.lookup_tokens} tokens, {name}",
                     f"{ours.percentile_us(0.5):,.0f} / {ours.percentile_us(0.99):,.0f}",
                     f"{without.percentile_us(0.5):,.0f} / {without.percentile_us(0.99):,.0f}",
                     f"{ours.cpu_us_per_call(ours.server_cpu_ns):,.0f} / "
                     f"{without.cpu_us_per_call(without.server_cpu_ns):,.0f}", f"{ratio:.2f}x",
                     f"<= {GOAL_LOOKUP:g}x" if judged else "", _report.verdict(ratio <= GOAL_LOOKUP) if judged else ""])
    return rows


# --------------------------------------------------------------------------------------------- 4. promotion

PROMOTION_LAYOUT = Layout("bench-t3-promotion", num_layers=16, num_kv_heads=8, head_dim=64, block_size=16)  # 512 KiB


class PromotionRounds:
    """Each round a fresh 4k-token prefix put through node A until T3 holds it; node C, which holds
    nothing of it, promotes it as an engine does (Acquire, Wait, Release; timed), and the plain
    client GETs the very values node C reads (the keys found in the cluster; timed)."""

    def __init__(self, cluster, on_a: KvtierClient, on_c: KvtierClient, baseline: NodePipelines, num_tokens: int,
                 rng: np.random.Generator) -> None:
        self.cluster, self.on_a, self.baseline, self.rng = cluster, on_a, baseline, rng
        self.session = on_c.attach(PROMOTION_LAYOUT, map_pool=False)
        self.num_tokens = num_tokens
        self.num_blocks = num_tokens // BLOCK_SIZE
        self.namespace = Namespace(PROMOTION_LAYOUT, tenant="", algo="sha256")
        self.num_rounds = 0
        self.results: dict[str, object] = {}

    def setup(self) -> None:
        if self.results:
            assert self.results.pop("ready") == self.num_blocks, "node C promoted fewer blocks than T3 holds"
            values = self.results.pop("baseline")
            assert all(v is not None for v in values) and sum(map(len, values)) == self.nbytes
            self.num_rounds += 1
        flush(self.cluster)
        self.tokens = random_tokens(self.rng, self.num_tokens)
        self.hashes = self.namespace.hash_blocks(self.tokens)
        packed, stride = pack_token_ids(self.tokens), 4 * BLOCK_SIZE
        before = t3_written(self.on_a, PROMOTION_LAYOUT.model_id)
        blocks = [(h, packed[i * stride:(i + 1) * stride], self.rng.bytes(PROMOTION_LAYOUT.bytes_per_block))
                  for i, h in enumerate(self.hashes)]
        assert self.on_a.put(PROMOTION_LAYOUT, blocks).num_blocks == self.num_blocks
        wait_t3_written(self.on_a, PROMOTION_LAYOUT.model_id, before + self.num_blocks)
        self.keys = [key for port in self.cluster.ports
                     for key in self.cluster.node_client(port).scan_iter(match="kvtierd:*", count=1000)]
        assert len(self.keys) == self.num_blocks, len(self.keys)
        self.nbytes = sum(self.cluster.node_client(self.cluster.key_owner(k)).strlen(k) for k in self.keys)

    def ours(self) -> None:
        request_id = f"promote-{self.num_rounds}"
        self.session.acquire(request_id, self.hashes, token_ids=self.tokens)
        self.results["ready"] = self.session.wait(request_id)
        self.session.release(request_id)

    def plain_gets(self) -> None:
        self.results["baseline"] = self.baseline.get(self.keys)


def bench_promotion(cluster, directory: str, args, rng) -> list[list[str]]:
    nbytes = args.promotion_tokens // BLOCK_SIZE * PROMOTION_LAYOUT.bytes_per_block
    pool_bytes = 2 * nbytes + (16 << 20)
    flush(cluster)
    with DaemonProcess(node_args(directory, "promote-a", cluster.seeds, pool_bytes, pool_bytes)) as a, \
            DaemonProcess(node_args(directory, "promote-c", cluster.seeds, pool_bytes, pool_bytes)) as c, \
            KvtierClient(a.address, timeout_s=CALL_TIMEOUT_S, max_message_bytes=MAX_MESSAGE_BYTES) as on_a, \
            KvtierClient(c.address, timeout_s=CALL_TIMEOUT_S, max_message_bytes=MAX_MESSAGE_BYTES) as on_c, \
            ThreadPoolExecutor(len(cluster.ports), thread_name_prefix="node-pipeline") as threads:
        baseline = NodePipelines(cluster, "hiredis", threads)
        try:
            state = PromotionRounds(cluster, on_a, on_c, baseline, args.promotion_tokens, rng)
            ours, plain = _report.time_interleaved([state.ours, state.plain_gets], rounds=args.rounds,
                                                   warmup=args.warmup, setup=state.setup)
            state.setup()  # checks the last round
        finally:
            baseline.close()
    mb_per_s = lambda ns: state.nbytes / (ns / 1e9) / 1e6  # noqa: E731
    ratio = plain.median_ns / ours.median_ns
    return [[f"Promotion of {args.promotion_tokens} tokens held only in T3 (Acquire + Wait) / GETs (hiredis)",
             _report.median_and_best(mb_per_s(ours.median_ns), mb_per_s(ours.best_ns)),
             _report.median_and_best(mb_per_s(plain.median_ns), mb_per_s(plain.best_ns)), f"{ratio:.2f}x",
             f">= {GOAL_PUT_GET:g}x", _report.verdict(ratio >= GOAL_PUT_GET)]]


# --------------------------------------------------------------------------------------------- 5. sealed

def sealed_node_args(directory: str, name: str, seeds: str, pool_bytes: int, key_file: str | None) -> list[str]:
    """A daemon with T3 on its own key prefix (`name`'s pair), T2 configured but not written to (T1 -> T2
    off), [encryption] on with `key_file` (None: off)."""
    path = os.path.join(directory, name)
    os.makedirs(path, exist_ok=True)
    extra = ["--set", f"server.max_message_bytes={MAX_MESSAGE_BYTES}", *ONE_LAYOUT,
             "--set", f"remote.endpoints={seeds}", "--set", "policy.t0_to_t1=write_through",
             "--set", "policy.t1_to_t2=off", "--set", f"remote.key_prefix={'sealed' if key_file else 'clear'}"]
    if key_file:
        extra += ["--set", "encryption.enabled=true", "--set", f"encryption.master_key_file={key_file}"]
    return small_daemon_args(path, t0_bytes=str(pool_bytes), host_bytes=str(pool_bytes), ssd_bytes="64MiB",
                             extra=extra)


class SealedRounds:
    """Each round two fresh chains put through both pairs' node A until T3 holds them; each pair's node B
    Gets the first and promotes the second (timed); `setup` checks the round before."""

    def __init__(self, cluster, putters: dict[str, KvtierClient], readers: dict[str, KvtierClient], num_blocks: int,
                 rng: np.random.Generator) -> None:
        self.cluster, self.putters, self.readers, self.num_blocks, self.rng = cluster, putters, readers, num_blocks, rng
        self.sessions = {side: client.attach(LAYOUT, map_pool=False) for side, client in readers.items()}
        self.namespace = Namespace(LAYOUT, tenant="", algo="sha256")
        self.results: dict[str, object] = {}
        self.num_rounds = 0

    def setup(self) -> None:
        if self.results:
            for side in self.readers:
                got = self.results.pop(f"get {side}")
                assert [h for h, _ in got] == self.chains[0][1], f"{side} Get returned {len(got)} blocks"
                assert all(data == value for (_, data), value in zip(got, self.values[0])), f"{side} Get: other bytes"
                assert self.results.pop(f"promote {side}") == self.num_blocks, f"{side} promoted fewer blocks"
            self.num_rounds += 1
        flush(self.cluster)
        self.chains, self.values = [], []
        for _ in range(2):
            tokens = random_tokens(self.rng, self.num_blocks * BLOCK_SIZE)
            self.chains.append((tokens, self.namespace.hash_blocks(tokens)))
            self.values.append([self.rng.bytes(BLOCK_BYTES) for _ in range(self.num_blocks)])
        for client in self.putters.values():
            before = t3_written(client, LAYOUT.model_id)
            for (tokens, hashes), values in zip(self.chains, self.values):
                packed, stride = pack_token_ids(tokens), 4 * BLOCK_SIZE
                blocks = [(h, packed[i * stride:(i + 1) * stride], v) for i, (h, v) in enumerate(zip(hashes, values))]
                assert client.put(LAYOUT, blocks).num_blocks == self.num_blocks
            wait_t3_written(client, LAYOUT.model_id, before + 2 * self.num_blocks)

    def get(self, side: str):
        def run() -> None:
            tokens, hashes = self.chains[0]
            self.results[f"get {side}"] = self.readers[side].get(LAYOUT, hashes, token_ids=tokens)
        return run

    def promote(self, side: str):
        def run() -> None:
            tokens, hashes = self.chains[1]
            request_id = f"promote-{self.num_rounds}"
            self.sessions[side].acquire(request_id, hashes, token_ids=tokens)
            self.results[f"promote {side}"] = self.sessions[side].wait(request_id)
            self.sessions[side].release(request_id)
        return run


def bench_sealed(cluster, directory: str, args, rng) -> list[list[str]]:
    key_file = os.path.join(directory, "master.key")
    with open(key_file, "w") as f:
        f.write(MASTER_KEY_HEX)
    os.chmod(key_file, 0o600)
    round_bytes = 2 * args.blocks * BLOCK_BYTES
    pool_bytes = 2 * round_bytes + 16 * BLOCK_BYTES  # T0 and T1 hold two rounds: the warm-up touches every slot
    flush(cluster)
    with contextlib.ExitStack() as stack:
        clients = {}
        for name, key in (("clear-a", None), ("clear-b", None), ("sealed-a", key_file), ("sealed-b", key_file)):
            daemon = stack.enter_context(DaemonProcess(sealed_node_args(directory, name, cluster.seeds, pool_bytes,
                                                                        key)))
            clients[name] = stack.enter_context(KvtierClient(daemon.address, timeout_s=CALL_TIMEOUT_S,
                                                             max_message_bytes=MAX_MESSAGE_BYTES))
        sides = ("clear", "sealed")
        state = SealedRounds(cluster, {side: clients[f"{side}-a"] for side in sides},
                             {side: clients[f"{side}-b"] for side in sides}, args.blocks, rng)
        ops = [state.get("clear"), state.get("sealed"), state.promote("clear"), state.promote("sealed")]
        timings = _report.time_interleaved(ops, rounds=args.rounds, warmup=args.warmup, setup=state.setup)
        assert state.num_rounds == args.rounds + args.warmup, state.num_rounds
        sealed_t3 = t3_stats(clients["sealed-b"], LAYOUT.model_id)
        assert sealed_t3 is not None and sealed_t3.num_corrupt_blocks == 0, sealed_t3
    chain_bytes = args.blocks * BLOCK_BYTES
    mb_per_s = lambda ns: chain_bytes / (ns / 1e9) / 1e6  # noqa: E731
    rows = []
    for case, clear, sealed in (("Get on B from T3", timings[0], timings[1]),
                                ("Promotion on B from T3 (Acquire + Wait)", timings[2], timings[3])):
        ratio = clear.median_ns / sealed.median_ns
        rows.append([f"{case}, {args.blocks} x 2 MiB", _report.median_and_best(mb_per_s(sealed.median_ns),
                                                                               mb_per_s(sealed.best_ns)),
                     _report.median_and_best(mb_per_s(clear.median_ns), mb_per_s(clear.best_ns)), f"{ratio:.2f}x",
                     f">= {GOAL_SEALED:g}x", _report.verdict(ratio >= GOAL_SEALED)])
    return rows


# --------------------------------------------------------------------------------------------- main

def parse_args(argv: Sequence[str] | None):
    parser = _report.argument_parser(__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, help="blocks of 2 MiB per Put / Get round (64; --quick 8)")
    parser.add_argument("--rounds", type=int, help="timed Put / Get rounds (10; --quick 2)")
    parser.add_argument("--prefix-tokens", type=int, help="TTFT: shared prefix tokens (2048; --quick 256)")
    parser.add_argument("--ttft-rounds", type=int, help="TTFT rounds, a fresh prefix each (3; --quick 1)")
    parser.add_argument("--lookup-tokens", type=int, help="Lookup: prompt tokens (4096; --quick 1024)")
    parser.add_argument("--profile", metavar="DIR", help="py-spy the daemons during 10 more Puts and Gets")
    parser.add_argument("--promotion-tokens", type=int, help="promotion: prefix tokens (4096; --quick 512)")
    parser.add_argument("--parts", default="put-get,promotion,ttft,lookup,sealed",
                        help="which parts to run (default: all five)")
    args = parser.parse_args(argv)
    quick = args.quick
    defaults = dict(blocks=8 if quick else 64, rounds=2 if quick else 10, prefix_tokens=256 if quick else 2048,
                    ttft_rounds=1 if quick else 3, lookup_tokens=1024 if quick else 4096,
                    promotion_tokens=512 if quick else 4096)
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.warmup = 2  # T0 and T1 hold two rounds: the warm-up writes every slot once
    args.lookup_rounds, args.window_s = (1, 0.3) if quick else (3, 1.0)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        redis_cluster.install()
    except redis_cluster.RedisClusterError as e:
        print(f"bench_t3: {e}", file=sys.stderr)
        return 2
    import redis

    rng = np.random.default_rng(20240601)
    with tempfile.TemporaryDirectory(prefix="kvtierd-bench-t3-") as directory:
        with redis_cluster.start_cluster(os.path.join(directory, "cluster"), maxmemory=MAXMEMORY,
                                         die_with_parent=True) as cluster:
            with contextlib.closing(cluster.node_client(cluster.ports[0])) as client:
                version = client.info("server")["redis_version"]
            parts = set(args.parts.split(","))
            put_get_rows, notes = bench_put_get(cluster, directory, args, rng) if "put-get" in parts else ([], [])
            if "promotion" in parts:
                put_get_rows += bench_promotion(cluster, directory, args, rng)
            ttft_rows = bench_ttft(cluster, directory, args, rng) if "ttft" in parts else []
            lookup_rows = bench_lookup(cluster, directory, args, rng) if "lookup" in parts else []
            sealed_rows = bench_sealed(cluster, directory, args, rng) if "sealed" in parts else []
    print_header(args, cluster, version, redis, notes)
    if put_get_rows:
        print_put_get(args, put_get_rows)
    if ttft_rows:
        print_ttft(args, ttft_rows)
    if lookup_rows:
        print_lookup(args, lookup_rows)
    if sealed_rows:
        print_sealed(args, sealed_rows)
    for line in PROFILES:
        print(line)
    return 0


def print_put_get(args, put_get_rows) -> None:
    _report.print_table(["Put / Get of %d x 2 MiB" % args.blocks, "ours MB/s", "baseline MB/s", "ratio", "goal",
                         "result"], put_get_rows)
    print(f"MB/s = {args.blocks * BLOCK_BYTES:,} bytes / time (MB = 10^6 bytes); ratio = ours MB/s / baseline MB/s "
          "on the medians (best round in brackets); the judged baseline is the fastest client setting of the run, "
          "named in brackets; [baseline] rows: each setting's MB/s and its ratio to ours")
    print()


def print_ttft(args, ttft_rows) -> None:
    _report.print_table(["TTFT on node B", "ours ms", "recompute ms", "speedup", "goal", "result"], ttft_rows)
    print("TTFT as the runner measures it (admission to first token: hashing, Acquire, Wait, prefill); medians over "
          f"{args.ttft_rounds} rounds, a fresh prefix each (best in brackets); speedup = recompute / ours")
    print()


def print_lookup(args, lookup_rows) -> None:
    _report.print_table(["Lookup", "with T3 p50 / p99 us", "without p50 / p99 us", "daemon CPU us/call", "ratio",
                         "goal", "result"], lookup_rows)
    print("ratio = p50 with T3 (node B) / p50 without (a daemon with no [remote]), one task looping Lookups, the "
          f"sides alternating window by window ({args.lookup_rounds} x {args.window_s:g} s a side); daemon CPU: "
          "with / without, from /proc")


def print_sealed(args, sealed_rows) -> None:
    _report.print_table(["T3 reads, [encryption] on / off", "sealed MB/s", "clear MB/s", "ratio", "goal", "result"],
                        sealed_rows)
    print(f"MB/s = {args.blocks * BLOCK_BYTES:,} bytes / time; ratio = clear time / sealed time on the medians over "
          f"{args.rounds} rounds (best round in brackets); the four ops alternate, a fresh chain each round")
    print()


def print_header(args, cluster: redis_cluster.LocalRedis, version: str, redis_module, notes: list[str]) -> None:
    _report.print_header("T3 on a loopback Redis Cluster: Put / Get through two daemons, TTFT of a T3 hit, Lookup "
                         "with T3", args.quick)
    print(f"machine: {os.cpu_count()} CPUs, shared by this client process, the daemons and the "
          f"{len(cluster.ports)} redis-servers")
    print(f"cluster: redis-server {version}, {len(cluster.ports)} masters on 127.0.0.1 (scripts/redis_cluster.py), "
          f"--save '' --appendonly no --maxmemory {MAXMEMORY} allkeys-lru, flushed between rounds")
    print(f"daemons: kvtierd serve on unix sockets, T2 off; with T3: remote.endpoints = the masters, "
          f"policy.t0_to_t1 = write_through; redis-py {redis_module.__version__} "
          f"(hiredis {'installed' if redis_module.utils.HIREDIS_AVAILABLE else 'not installed'})")
    for line in notes:
        print(line)
    print(f"Put / Get: {args.rounds} rounds after {args.warmup} warm-up rounds, ours and the baselines alternating "
          f"op by op; {_report.TIMING_NOTE.split('; ', 1)[1]}")
    print()


if __name__ == "__main__":
    sys.exit(main())
