"""A real Redis Cluster for the T3 tier's tests: start, kill a node, find who owns a slot, always tear down.

Over scripts/redis_cluster.py (the library of scripts/redis-cluster): `running_cluster(tmp_path)` starts
3 masters of Debian's redis-server 7.0.15 on free 127.0.0.1 ports (scripts/install-redis-server puts it
into .tools/bin on first use; a failed install FAILS the test with the script's output, it never
skips), forms the cluster, waits until every node agrees on all 16384 slots, and stops every
server when the block ends; the servers also die with the test process (PR_SET_PDEATHSIG).
`--cluster-require-full-coverage no` and a cluster-node-timeout of 3 s: after `kill_node(cluster, port)`
(SIGKILL) the other masters go on serving their slots, and mark the dead one FAIL within a few seconds
(`wait_node_marked_failed`). `owner_port(cluster, key)` asks a live node's CLUSTER SLOTS which master
owns the key's slot; `cluster.slots_of(port)` gives the ranges a node owned when the cluster formed;
`keys_owned_by(cluster, port, n)` makes keys that land on one node.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from scripts.redis_cluster import (
    DEFAULT_NODE_TIMEOUT_MS,
    NUM_SLOTS,
    LocalRedis,
    RedisClusterError,
    install,
    key_slot,
    start_cluster,
    start_single,
)

__all__ = ["NUM_SLOTS", "LocalRedis", "ensure_redis_installed", "keys_owned_by", "kill_node", "owner_port",
           "running_cluster", "running_single", "wait_until", "wait_node_marked_failed"]

_installed: bool = False


def ensure_redis_installed() -> None:
    """scripts/install-redis-server, once per session; a failure fails the test with its reason (CI installs it)."""
    global _installed
    if _installed:
        return
    try:
        install()
    except RedisClusterError as e:
        pytest.fail(f"the T3 tests need redis-server and redis-cli: {e}", pytrace=False)
    _installed = True


@contextlib.contextmanager
def running_cluster(directory: Path, *, masters: int = 3, **options) -> Iterator[LocalRedis]:
    """A formed cluster of `masters` masters in `directory` (options: username, password, tls_dir, maxmemory,
    node_timeout_ms), stopped (SIGTERM, then SIGKILL) when the block ends, whatever happened in it."""
    ensure_redis_installed()
    try:
        cluster = start_cluster(directory, masters=masters, die_with_parent=True, **options)
    except RedisClusterError as e:
        pytest.fail(f"the Redis Cluster did not start: {e}", pytrace=False)
    try:
        yield cluster
    finally:
        cluster.stop()


@contextlib.contextmanager
def running_single(directory: Path, **options) -> Iterator[LocalRedis]:
    """One plain (non-cluster) redis-server in `directory`, stopped when the block ends."""
    ensure_redis_installed()
    try:
        server = start_single(directory, die_with_parent=True, **options)
    except RedisClusterError as e:
        pytest.fail(f"redis-server did not start: {e}", pytrace=False)
    try:
        yield server
    finally:
        server.stop()


def kill_node(cluster: LocalRedis, port: int) -> list[tuple[int, int]]:
    """SIGKILL the master on `port` (reaped before this returns); returns the slot ranges it owned."""
    owned = cluster.slots_of(port)
    cluster.kill_node(port)
    return owned


def owner_port(cluster: LocalRedis, key: bytes | str) -> int:
    """The port of the master that owns `key`'s slot now, from the CLUSTER SLOTS of the first live node."""
    slot = key_slot(key)
    for port in cluster.ports:
        if cluster.nodes[port].alive():
            for first, last, owner in cluster.read_slot_ranges(port):
                if first <= slot <= last:
                    return owner
            raise KeyError(f"slot {slot} of {key!r} is not assigned")
    raise RuntimeError("no node of the cluster is alive")


def keys_owned_by(cluster: LocalRedis, port: int, count: int, prefix: str = "k") -> list[bytes]:
    """`count` distinct keys whose slots `port` owned when the cluster formed."""
    keys: list[bytes] = []
    i = 0
    while len(keys) < count:
        key = f"{prefix}:{i}".encode()
        if cluster.key_owner(key) == port:
            keys.append(key)
        i += 1
    return keys


def wait_until(condition: Callable[[], object], *, timeout_s: float, what: str, interval_s: float = 0.05):
    """Polls `condition` until it returns something true (returned); fails the test naming `what` on timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = condition()
        if result:
            return result
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s:g} s waiting for {what}", pytrace=False)
        time.sleep(interval_s)


def wait_node_marked_failed(cluster: LocalRedis, dead_port: int, *, timeout_s: float | None = None) -> None:
    """Waits until every live master's CLUSTER NODES flags the node on `dead_port` as `fail` (not just
    `fail?`): what they agree on once cluster-node-timeout has passed and a majority of masters saw it."""
    timeout_s = 10 * DEFAULT_NODE_TIMEOUT_MS / 1000 if timeout_s is None else timeout_s
    live = [port for port in cluster.ports if port != dead_port and cluster.nodes[port].alive()]

    def flags_fail(port: int) -> bool:
        with contextlib.closing(cluster.node_client(port, socket_timeout=5)) as client:
            nodes = client.execute_command("CLUSTER NODES")
        if isinstance(nodes, dict):  # redis-py parses CLUSTER NODES into {"host:port@bus": {...}}
            return any(address.split("@")[0].endswith(f":{dead_port}") and "fail" in info["flags"].split(",")
                       for address, info in nodes.items())
        text = nodes.decode() if isinstance(nodes, bytes) else nodes
        return any(f":{dead_port}@" in line and "fail" in line.split()[2].split(",") for line in text.splitlines())

    wait_until(lambda: all(flags_fail(port) for port in live), timeout_s=timeout_s,
               what=f"the live masters {live} to mark {dead_port} as fail")
