"""Redis Cluster clients for the T3 tier: SET and GET of 64 values of 2 MiB on a real 3-master cluster.

The cluster: scripts/redis_cluster.py's, started and stopped by this script (Debian's redis-server from
.tools/bin, scripts/install-redis-server runs first), 3 masters on free 127.0.0.1 ports, --save ""
--appendonly no, maxmemory 1 GB each (allkeys-lru). The 64 values are random, their keys 32-byte
block hashes spread over the 3 masters by slot; every client SETs all 64 and GETs all 64 each round.

The clients, all timed in the same rounds in alternation (benchmarks/_report.time_interleaved):
  (a) redis-py RedisCluster, one pipeline (transaction=False) of 64 commands, pure-Python RESP
      (parser _RESP2Parser and PythonRespSerializer forced, as without hiredis): the baseline;
  (b) the same with hiredis (redis-py's default parser and packer once `hiredis` is installed), and
      (b') with hiredis parsing replies but commands packed in Python (no copy of a 2 MiB value);
  (c) per-node pipelines: the keys grouped by RedisCluster.get_node_from_key, one pipeline per master
      on get_redis_connection(node), the 3 run at once on 3 threads (pure-Python RESP, and hiredis),
      and (c') with hiredis parsing and the Python packer;
  (d) valkey-glide's sync client (GlideClusterClient, a non-atomic ClusterBatch), where it imports;
  (e) redis.asyncio.RedisCluster, one pipeline, on an event loop (the daemon's side is asyncio);
  (f) kvtierd's own RedisStore (t3/redis_store.py): per node, one write of hand-packed SETs (a value sent
      from where it lies) or GETs whose values are received straight into buffers of their own
      (t3/redis_connections.py BulkReader), the 3 masters on 3 threads.
Extra rows: a plain redis.Redis on one master: one GET of one 2 MiB value, 64 GETs one by one, one
pipeline of 64 GETs (keys of one hash tag, so all on that master): one connection's ceiling.
Untimed between rounds: every GET result of the round before is checked against the values.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
import tempfile
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import _report  # noqa: E402
from scripts import redis_cluster  # noqa: E402

NUM_VALUES = 64
VALUE_BYTES = 2 << 20  # 2 MiB, one Llama-3-8B block (benchmarks/bench_put_get.py)
TOTAL_BYTES = NUM_VALUES * VALUE_BYTES
MAXMEMORY = "1gb"  # per master; every client writes the same 64 keys, ~45 MB a master
TIMEOUT_S = 120.0
BASELINE = "(a)"


def connection_class(*, hiredis_parser: bool):
    """A redis.Connection that packs commands in Python (PythonRespSerializer: a value over 6,000 bytes is
    sent as it is, not copied into one buffer as hiredis' pack_command does) and parses replies with
    hiredis or in Python (_RESP2Parser), whether or not hiredis is installed."""
    import redis
    from redis._parsers import _HiredisParser, _RESP2Parser
    from redis.connection import PythonRespSerializer

    class PythonPackerConnection(redis.Connection):
        def __init__(self, **kwargs):
            kwargs["parser_class"] = _HiredisParser if hiredis_parser else _RESP2Parser
            super().__init__(**kwargs)

        def _construct_command_packer(self, packer):
            return packer if packer is not None else PythonRespSerializer(self._buffer_cutoff, self.encoder.encode)

    return PythonPackerConnection


def pure_python_connection_class():
    """A redis.Connection that parses and packs RESP in Python even where hiredis is installed."""
    return connection_class(hiredis_parser=False)


def hiredis_in_use(client) -> bool:
    """Whether a redis.Redis' connections parse with hiredis (checked on a live connection)."""
    from redis._parsers import _HiredisParser

    connection = client.connection_pool.get_connection()
    try:
        return isinstance(connection._parser, _HiredisParser)
    finally:
        client.connection_pool.release(connection)


class RedisPyCluster:
    """(a), (b): one RedisCluster pipeline; (c): per-node pipelines on one thread per master.

    `parser`: "python" (pure-Python RESP both ways), "hiredis" (redis-py's default with hiredis installed:
    hiredis packs and parses), "hiredis-parser" (hiredis parses, Python packs)."""

    def __init__(self, cluster: redis_cluster.LocalRedis, *, parser: str) -> None:
        import redis

        if parser != "hiredis":  # RedisCluster passes connection_class to its node pools only when made from a URL
            self.client = redis.RedisCluster.from_url(
                f"redis://{cluster.endpoints[0]}", socket_timeout=TIMEOUT_S,
                connection_class=connection_class(hiredis_parser=parser == "hiredis-parser"),
                **cluster.connection_kwargs())
        else:
            self.client = cluster.cluster_client(socket_timeout=TIMEOUT_S)
        self.threads = ThreadPoolExecutor(len(cluster.ports), thread_name_prefix="node-pipeline")
        self.hiredis = hiredis_in_use(self.client.get_redis_connection(self.client.get_primaries()[0]))

    def close(self) -> None:
        self.threads.shutdown()
        self.client.close()

    def pipeline_set(self, keys: list[bytes], values: list[bytes]) -> None:
        pipeline = self.client.pipeline(transaction=False)
        for key, value in zip(keys, values):
            pipeline.set(key, value)
        assert all(pipeline.execute())

    def pipeline_get(self, keys: list[bytes]) -> list[bytes]:
        pipeline = self.client.pipeline(transaction=False)
        for key in keys:
            pipeline.get(key)
        return pipeline.execute()

    def _by_node(self, keys: list[bytes]) -> dict:
        groups: dict = {}
        for index, key in enumerate(keys):
            node = self.client.get_node_from_key(key)
            groups.setdefault(node.name, (node, []))[1].append(index)
        return groups

    def _on_nodes(self, keys: list[bytes], queue: Callable[[object, int], None]) -> list:
        """Runs one pipeline per master at once; returns the replies in the order of `keys`."""
        def run(node, indexes: list[int]) -> tuple[list[int], list]:
            pipeline = self.client.get_redis_connection(node).pipeline(transaction=False)
            for index in indexes:
                queue(pipeline, index)
            return indexes, pipeline.execute()

        replies: list = [None] * len(keys)
        for indexes, results in [f.result() for f in [self.threads.submit(run, node, indexes)
                                                       for node, indexes in self._by_node(keys).values()]]:
            for index, result in zip(indexes, results):
                replies[index] = result
        return replies

    def node_pipelines_set(self, keys: list[bytes], values: list[bytes]) -> None:
        assert all(self._on_nodes(keys, lambda pipeline, i: pipeline.set(keys[i], values[i])))

    def node_pipelines_get(self, keys: list[bytes]) -> list[bytes]:
        return self._on_nodes(keys, lambda pipeline, i: pipeline.get(keys[i]))


class AsyncRedisPyCluster:
    """(e): redis.asyncio.RedisCluster, one pipeline, driven on an event loop of its own (redis-py's
    default parser: hiredis where installed; the asyncio client packs commands in Python)."""

    def __init__(self, cluster: redis_cluster.LocalRedis) -> None:
        import asyncio

        import redis.asyncio
        from redis.asyncio.cluster import ClusterNode

        self.runner = asyncio.Runner()
        self.client = redis.asyncio.RedisCluster(
            startup_nodes=[ClusterNode(redis_cluster.HOST, port) for port in cluster.ports], socket_timeout=TIMEOUT_S,
            **cluster.connection_kwargs())
        self.runner.run(self.client.initialize())

    def close(self) -> None:
        self.runner.run(self.client.aclose())
        self.runner.close()

    def pipeline_set(self, keys: list[bytes], values: list[bytes]) -> None:
        async def run():
            pipeline = self.client.pipeline(transaction=False)
            for key, value in zip(keys, values):
                pipeline.set(key, value)
            return await pipeline.execute()

        assert all(self.runner.run(run()))

    def pipeline_get(self, keys: list[bytes]) -> list[bytes]:
        async def run():
            pipeline = self.client.pipeline(transaction=False)
            for key in keys:
                pipeline.get(key)
            return await pipeline.execute()

        return self.runner.run(run())


class Glide:
    """(d): valkey-glide's sync GlideClusterClient, one non-atomic ClusterBatch."""

    def __init__(self, cluster: redis_cluster.LocalRedis) -> None:
        from glide_sync import ClusterBatch, GlideClusterClient, GlideClusterClientConfiguration, NodeAddress

        self.batch_class = ClusterBatch
        config = GlideClusterClientConfiguration([NodeAddress(redis_cluster.HOST, port) for port in cluster.ports],
                                                 request_timeout=int(TIMEOUT_S * 1000))
        self.client = GlideClusterClient.create(config)

    def close(self) -> None:
        self.client.close()

    def batch_set(self, keys: list[bytes], values: list[bytes]) -> None:
        batch = self.batch_class(is_atomic=False)
        for key, value in zip(keys, values):
            batch.set(key, value)
        assert all(reply == "OK" or reply == b"OK" for reply in self.client.exec(batch, raise_on_error=True))

    def batch_get(self, keys: list[bytes]) -> list[bytes]:
        batch = self.batch_class(is_atomic=False)
        for key in keys:
            batch.get(key)
        return self.client.exec(batch, raise_on_error=True)


def glide_or_reason(cluster: redis_cluster.LocalRedis) -> tuple[Glide | None, str]:
    try:
        import glide_sync
    except ImportError as e:
        return None, f"not installed ({e}; pip install valkey-glide-sync)"
    try:
        from importlib.metadata import version

        return Glide(cluster), f"valkey-glide-sync {version('valkey-glide-sync')} ({glide_sync.__name__})"
    except Exception as e:  # a wheel that imports but does not run here
        return None, f"does not run here: {type(e).__name__}: {e}"


def main(argv: Sequence[str] | None = None) -> int:
    args = _report.parse_args(__doc__.splitlines()[0], argv)
    rounds, warmup = (2, 1) if args.quick else (10, 2)
    try:
        redis_cluster.install()
    except redis_cluster.RedisClusterError as e:
        print(f"bench_redis_clients: {e}", file=sys.stderr)
        return 2
    import redis

    rng = np.random.default_rng(20240601)
    values = [rng.bytes(VALUE_BYTES) for _ in range(NUM_VALUES)]
    keys = [hashlib.sha256(b"block %d" % i).digest() for i in range(NUM_VALUES)]
    with tempfile.TemporaryDirectory(prefix="kvtierd-bench-redis-") as directory, \
            redis_cluster.start_cluster(directory, maxmemory=MAXMEMORY, die_with_parent=True) as cluster, \
            contextlib.ExitStack() as clients:
        pure = RedisPyCluster(cluster, parser="python")
        clients.callback(pure.close)
        assert not pure.hiredis
        hiredis = hiredis_parser = None
        if redis.utils.HIREDIS_AVAILABLE:
            hiredis = RedisPyCluster(cluster, parser="hiredis")
            clients.callback(hiredis.close)
            assert hiredis.hiredis, "hiredis is installed but redis-py's connections do not parse with it"
            hiredis_parser = RedisPyCluster(cluster, parser="hiredis-parser")
            clients.callback(hiredis_parser.close)
            assert hiredis_parser.hiredis
        async_client = AsyncRedisPyCluster(cluster)
        clients.callback(async_client.close)
        glide, glide_note = glide_or_reason(cluster)
        if glide is not None:
            clients.callback(glide.close)

        # One master, one plain connection: keys of one hash tag all live on its slot's master.
        tagged = [b"{one-node}" + key for key in keys]
        node_port = cluster.key_owner(tagged[0])
        single = clients.enter_context(contextlib.closing(cluster.node_client(node_port, socket_timeout=TIMEOUT_S)))
        single_pipeline = single.pipeline(transaction=False)
        for key, value in zip(tagged, values):
            single_pipeline.set(key, value)
        single_pipeline.execute()

        print_header(args.quick, cluster, redis, pure, hiredis, glide_note, rounds, warmup)
        cases = Cases(keys, values, tagged, single)
        cases.add("(a) RedisCluster pipeline, pure-Python RESP", pure.pipeline_set, pure.pipeline_get)
        if hiredis is not None:
            cases.add("(b) RedisCluster pipeline, hiredis", hiredis.pipeline_set, hiredis.pipeline_get)
            cases.add("(b') RedisCluster pipeline, hiredis parser, Python packer", hiredis_parser.pipeline_set,
                      hiredis_parser.pipeline_get)
        cases.add("(c) per-node pipelines on 3 threads, pure-Python RESP", pure.node_pipelines_set,
                  pure.node_pipelines_get)
        if hiredis is not None:
            cases.add("(c) per-node pipelines on 3 threads, hiredis", hiredis.node_pipelines_set,
                      hiredis.node_pipelines_get)
            cases.add("(c') per-node pipelines on 3 threads, hiredis parser, Python packer",
                      hiredis_parser.node_pipelines_set, hiredis_parser.node_pipelines_get)
        if glide is not None:
            cases.add("(d) valkey-glide sync, ClusterBatch", glide.batch_set, glide.batch_get)
        async_parser = "hiredis" if redis.utils.HIREDIS_AVAILABLE else "pure-Python"
        cases.add(f"(e) redis.asyncio RedisCluster pipeline, {async_parser} parser", async_client.pipeline_set,
                  async_client.pipeline_get)
        store = KvtierdStore(cluster)
        clients.callback(store.close)
        cases.add("(f) kvtierd's RedisStore: per-node writes of hand-packed commands on 3 threads, values "
                  "received straight into their buffers", store.set, store.get)
        timings = _report.time_interleaved(cases.ops, rounds=rounds, warmup=warmup, setup=cases.check)
    rows = cases.rows(timings)
    _report.print_table(["client", "op", "MB/s", "(best)", f"vs {BASELINE}", "(best)"], rows)
    print()
    print(f"MB/s = bytes moved / time (MB = 10^6 bytes): {TOTAL_BYTES:,} a SET or GET of all {NUM_VALUES} values, "
          f"{VALUE_BYTES:,} a single GET; vs {BASELINE} = MB/s / {BASELINE}'s MB/s for the same op, on the medians "
          "(best: on the best rounds)")
    if hiredis is None:
        print("(b) and the hiredis rows: hiredis is not installed (pip install hiredis)")
    if glide is None:
        print(f"(d) valkey-glide: {glide_note}")
    return 0


class KvtierdStore:
    """The daemon's own client of the shared store (kvtierd.t3.redis_store.RedisStore)."""

    def __init__(self, cluster: redis_cluster.LocalRedis) -> None:
        from kvtierd.t3.redis_store import RedisStore
        from kvtierd.t3.remote_config import RemoteConfig

        self.store = RedisStore(RemoteConfig(tuple(("127.0.0.1", port) for port in cluster.ports), timeout_s=TIMEOUT_S))

    def close(self) -> None:
        self.store.close()

    def set(self, keys: list[bytes], values: list[bytes]) -> None:
        assert all(self.store.set(list(zip(keys, values))))

    def get(self, keys: list[bytes]) -> list:
        return self.store.get(keys)


class Cases:
    """The timed ops in round order (every SET, then every GET, then the one-node GETs) and their checks."""

    def __init__(self, keys: list[bytes], values: list[bytes], tagged: list[bytes], single) -> None:
        self.keys, self.values, self.tagged, self.single = keys, values, tagged, single
        self.parser = "hiredis" if hiredis_in_use(single) else "pure-Python RESP"
        self.sets: list[tuple[str, Callable[[], None]]] = []
        self.gets: list[tuple[str, Callable[[], None]]] = []
        self.results: dict[str, list] = {}
        self.lock = threading.Lock()

    def add(self, name: str, set_op, get_op) -> None:
        self.sets.append((name, lambda: set_op(self.keys, self.values)))
        self.gets.append((name, lambda: self.results.__setitem__(name, get_op(self.keys))))

    @property
    def extras(self) -> list[tuple[str, Callable[[], None], int]]:
        """(name, op, bytes moved) on one master's plain redis.Redis."""
        single, tagged = self.single, self.tagged

        def one_get() -> None:
            self.results["one GET"] = [single.get(tagged[0])]

        def gets() -> None:
            self.results["64 GETs"] = [single.get(key) for key in tagged]

        def pipelined() -> None:
            pipeline = single.pipeline(transaction=False)
            for key in tagged:
                pipeline.get(key)
            self.results["pipeline of 64 GETs"] = pipeline.execute()

        return [("one GET", one_get, VALUE_BYTES), ("64 GETs", gets, TOTAL_BYTES),
                ("pipeline of 64 GETs", pipelined, TOTAL_BYTES)]

    @property
    def ops(self) -> list[Callable[[], None]]:
        return [op for _, op in self.sets] + [op for _, op in self.gets] + [op for _, op, _ in self.extras]

    def check(self) -> None:
        for name, result in self.results.items():
            want = self.values[:1] if name == "one GET" else self.values
            assert result == want, f"{name} returned other bytes"
        self.results.clear()

    def rows(self, timings: list[_report.Timings]) -> list[list[str]]:
        sets = timings[:len(self.sets)]
        gets = timings[len(self.sets):len(self.sets) + len(self.gets)]
        extras = timings[len(self.sets) + len(self.gets):]
        rows = []
        for op, names, op_timings in (("SET", self.sets, sets), ("GET", self.gets, gets)):
            base = op_timings[0]
            for (name, _), timing in zip(names, op_timings):
                rows.append(row(name, op, timing, TOTAL_BYTES, base))
        get_base = gets[0]
        for (name, _, moved), timing in zip(self.extras, extras):
            rows.append(row(f"[extra] redis.Redis on one master, {self.parser}", name, timing, moved, get_base))
        return rows


def row(client: str, op: str, timing: _report.Timings, moved: int, base: _report.Timings) -> list[str]:
    median, best = mb_per_s(moved, timing.median_ns), mb_per_s(moved, timing.best_ns)
    base_median, base_best = mb_per_s(TOTAL_BYTES, base.median_ns), mb_per_s(TOTAL_BYTES, base.best_ns)
    return [client, op, f"{median:,.0f}", f"({best:,.0f})", f"{median / base_median:.2f}x",
            f"({best / base_best:.2f}x)"]


def mb_per_s(moved: int, ns: float) -> float:
    return moved / (ns / 1e9) / 1e6


def print_header(quick: bool, cluster: redis_cluster.LocalRedis, redis_module, pure: RedisPyCluster,
                 hiredis: RedisPyCluster | None, glide_note: str, rounds: int, warmup: int) -> None:
    with contextlib.closing(cluster.node_client(cluster.ports[0])) as client:
        version = client.info("server")["redis_version"]
    _report.print_header(f"Redis Cluster clients: SET and GET of {NUM_VALUES} x {VALUE_BYTES >> 20} MiB values on a "
                         f"{len(cluster.ports)}-master cluster over loopback TCP", quick,
                         _report.TIMING_NOTE.replace("ours and baseline alternating", "every client in turn"))
    print(f"machine: {os.cpu_count()} CPUs, shared by this client process and the {len(cluster.ports)} redis-servers")
    print(f"cluster: redis-server {version} ({redis_cluster.TOOLS_BIN / 'redis-server'}), masters {cluster.seeds}, "
          f"--save '' --appendonly no --maxmemory {MAXMEMORY} allkeys-lru; slots "
          + ", ".join(f"{port}: {'/'.join(f'{a}-{b}' for a, b in cluster.slots_of(port))}" for port in cluster.ports))
    hiredis_note = "not installed" if hiredis is None else f"hiredis {hiredis_version()} parsing: {hiredis.hiredis}"
    print(f"redis-py {redis_module.__version__} (HIREDIS_AVAILABLE={redis_module.utils.HIREDIS_AVAILABLE}; "
          f"{hiredis_note}); valkey-glide: {glide_note}")
    print(f"{rounds} rounds after {warmup} warm-up rounds; each round: every client's SET of the 64 values, then "
          "every client's GET, then the one-master extras")
    print()


def hiredis_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("hiredis")
    except PackageNotFoundError:
        return "?"


if __name__ == "__main__":
    sys.exit(main())
