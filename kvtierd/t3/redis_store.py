"""The shared store's client: every node of a Redis Cluster (or one Redis / Valkey) behind its
own circuit breaker, keys batched per node.

A key goes to the node that owns its hash slot (CRC16 mod 16384, from CLUSTER SLOTS; no hash
tags, so a chain's blocks spread over every node). Each node's keys travel as one pipeline, and
the nodes' pipelines run in parallel. Nothing here raises to the caller for the store's sake: a
node that fails, times out or has its breaker open gives misses (`get`), False (`exists`) or
not-written (`set`) for its keys, and the others answer normally. A MOVED reply (slots moved)
is a miss too, and the slot table is read again on the next call.

Health is what the nodes did last: a node answers until a call to it fails, and again once one
succeeds. `probe()` asks every node (PING; the topology first while unknown), so that the daemon
knows the store before its first request and keeps knowing it with no traffic: the daemon
probes at start and every `remote.probe_interval_s` (`start_probing`). A half-open breaker's
probe is such a call: a node still dead fails it and stays unreachable. `num_reachable` says,
from that knowledge alone, how far a chain's keys stay on reachable nodes (what a Lookup promises).

Called from the movers' threads and executors, never from the event loop: each call may wait up
to the socket timeout per node.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import redis
from redis.exceptions import AskError, ClusterDownError, NoPermissionError

from kvtierd.t3.block_frame import FrameValue
from kvtierd.t3.circuit_breaker import BreakerState
from kvtierd.t3.cluster_topology import ClusterTopology
from kvtierd.t3.redis_connections import HIREDIS, BulkReader, read_replies
from kvtierd.t3.remote_config import RemoteConfig
from kvtierd.t3.store_node import StoreHealth, StoreNode, endpoint_names

log = logging.getLogger(__name__)
_EXISTS = b"*2\r\n$6\r\nEXISTS\r\n$%d\r\n%s\r\n"  # one EXISTS in RESP, packed by hand
_GET = b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n"
_SMALL = 1 << 14  # a value below this is joined into the write before it


class StoreUnavailable(Exception):
    """The store did not answer a `command` (its message names the node and why, never a value)."""


class RedisStore:
    """Thread-safe: the counters under `_lock`; which node owns a key is `topology`'s (cluster_topology.py)."""

    def __init__(self, config: RemoteConfig, max_parallel_nodes: int = 8) -> None:
        self.config = config
        self._lock = threading.Lock()
        self.topology = ClusterTopology(config, self._seeds_failed)
        self._parallel = concurrent.futures.ThreadPoolExecutor(max_parallel_nodes, thread_name_prefix="kvtierd-t3")
        self.num_errors = 0
        self._last_failure: tuple[str, bool] = ("", False)  # (what failed, credentials refused)
        self._stop_probing = threading.Event()
        self._prober: threading.Thread | None = None

    @property
    def mode(self) -> str:
        """"cluster" or "single"; "unknown" until a seed answered (remote.mode auto)."""
        return self.topology.mode

    # ----------------------------------------------------------------------------- the three calls

    def get(self, keys: Sequence[bytes]) -> list[memoryview | None]:
        """Each key's value (a view of a buffer it was received straight into: BulkReader), None for a
        miss (absent, or its node failed or is open). Each node's GETs go out in one write, the
        nodes in parallel."""
        values: list[memoryview | None] = [None] * len(keys)

        def run(node: StoreNode, positions: list[int]) -> None:
            connection = self._send(node, [b"".join(_GET % (len(keys[i]), keys[i]) for i in positions)])
            if connection is None:
                return
            try:
                replies = BulkReader(connection).read(len(positions))
            except (redis.RedisError, OSError) as e:
                connection.disconnect()
                self._node_failed(node, e)
                return
            finally:
                node.client.connection_pool.release(connection)
            for i, reply in zip(positions, replies):
                if isinstance(reply, memoryview):
                    values[i] = reply
            self._replied(node, [reply for reply in replies if isinstance(reply, redis.RedisError)])

        self._on_each_node(self.topology.group(keys), run)
        return values

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        """Is each key present? Every node's EXISTS go out packed in one write before any reply
        is read (one round trip for all nodes, no thread): redis-py's Pipeline costs ~10 µs a
        command, and a probe of a 4k-token chain is 256 small commands (a Lookup's cost)."""
        present = [False] * len(keys)
        sent = []
        for node, positions in self.topology.group(keys).items():
            if node.breaker.allow():
                packed = b"".join(_EXISTS % (len(keys[i]), keys[i]) for i in positions)
                connection = self._send(node, [packed])
                if connection is not None:
                    sent.append((node, positions, connection))
        for node, positions, connection in sent:
            replies = self._receive(node, connection, len(positions))
            if replies is None:
                continue
            for position, reply in zip(positions, replies):
                present[position] = reply == 1
            self._replied(node, [reply for reply in replies if isinstance(reply, redis.RedisError)])
        return present

    def set(self, items: Sequence[tuple[bytes, bytes | FrameValue]], ttl_ms: int = 0) -> list[bool]:
        """SET each (key, value), expiring after `ttl_ms` milliseconds when given (PX); True where the
        node took it. Each node's SETs go out packed by hand as one write of many buffers, a
        FrameValue's payload sent from where it lies (no copy), the nodes in parallel; then their
        replies are read."""
        written = [False] * len(items)
        expiry = b"$2\r\nPX\r\n$%d\r\n%d\r\n" % (len(str(ttl_ms)), ttl_ms) if ttl_ms else b""
        head = b"*5\r\n$3\r\nSET\r\n" if ttl_ms else b"*3\r\n$3\r\nSET\r\n"

        def run(node: StoreNode, positions: list[int]) -> None:
            buffers: list = []
            pending = b""  # small pieces joined into the next write
            for i in positions:
                key, value = items[i]
                pending += head + b"$%d\r\n%s\r\n$%d\r\n" % (len(key), key, len(value))
                if isinstance(value, FrameValue):
                    buffers += [pending + value.head, value.payload]
                else:
                    buffers += [pending + value] if len(value) < _SMALL else [pending, value]
                pending = b"\r\n" + expiry
            buffers.append(pending)
            connection = self._send(node, buffers)
            replies = self._receive(node, connection, len(positions)) if connection is not None else None
            if replies is None:
                return
            for i, reply in zip(positions, replies):
                written[i] = reply == b"OK"
            self._replied(node, [reply for reply in replies if isinstance(reply, redis.RedisError)])

        self._on_each_node(self.topology.group([key for key, _ in items]), run)
        return written

    def command(self, key: bytes, *args: bytes | str) -> Any:
        """One command (`args`: its name, `key` and the rest) on the node that owns `key`, and its
        reply; StoreUnavailable when no node serves the key, its breaker is open or the call fails.
        For the few small records beside the blocks (t3/key_records.py), not for blocks."""
        table = self.topology.slot_table()
        node = None if table is None else self.topology.owner(table, key)
        if node is None or not node.breaker.allow():
            raise StoreUnavailable("no reachable store node serves the key")
        try:
            reply = node.client.execute_command(*args)
        except (AskError, ClusterDownError) as e:  # the slot moved: the table is read again
            self._replied(node, [e])
            raise StoreUnavailable(f"{endpoint_names([node.address])}: {type(e).__name__}") from None
        except (redis.RedisError, OSError) as e:
            self._node_failed(node, e)
            raise StoreUnavailable(node.failure[0]) from None
        self._replied(node, [])
        return reply

    def _send(self, node: StoreNode, packed: list) -> redis.Connection | None:
        """A pooled connection of the node with the `packed` commands (buffers, sent in order)
        written to it; None: it failed."""
        pool = node.client.connection_pool
        try:
            connection = pool.get_connection()
        except (redis.RedisError, OSError) as e:
            self._node_failed(node, e)
            return None
        try:
            connection.send_packed_command(packed, check_health=False)
        except (redis.RedisError, OSError) as e:
            connection.disconnect()
            pool.release(connection)
            self._node_failed(node, e)
            return None
        return connection

    def _receive(self, node: StoreNode, connection: redis.Connection, num_replies: int) -> list | None:
        """`num_replies` replies off a connection `_send` wrote to (an error reply as its
        exception), the connection given back; None when it broke (the node failed)."""
        try:
            if HIREDIS:  # many small replies: parsed straight off the socket
                return read_replies(connection, num_replies)
            replies = []
            for _ in range(num_replies):
                try:
                    replies.append(connection.read_response())
                except (redis.ResponseError, redis.AuthenticationError) as e:
                    replies.append(e)
            return replies
        except (redis.RedisError, OSError) as e:
            connection.disconnect()
            self._node_failed(node, e)
            return None
        finally:
            node.client.connection_pool.release(connection)

    def num_reachable(self, keys: Sequence[bytes]) -> int:
        """How many leading `keys` live on nodes known reachable now (StoreNode.reachable); 0 with no
        slot table. Asks no node: one that died since its last call (or PING) is not known yet."""
        table = self.topology.known_table()
        if table is None:
            return 0
        down = {node for node in self.topology.serving_nodes() if not node.reachable}
        for position, key in enumerate(keys):
            node = self.topology.owner(table, key)
            if node is None or node in down:
                return position
        return len(keys)

    def all_reachable(self) -> bool:
        """Every slot has a master and every master is known reachable: num_reachable is every key."""
        return self.topology.complete() and all(node.reachable for node in self.topology.serving_nodes())

    def health(self) -> StoreHealth:
        topology = self.topology
        nodes = topology.serving_nodes()
        states = [node.breaker.state for node in nodes] + [topology.seeds.state]
        num_open = sum(not node.reachable for node in nodes)
        if topology.mode == "unknown":  # no endpoint answered yet: every seed is unreachable
            num_open = len(self.config.endpoints)
            nodes = [None] * num_open
        worst = (BreakerState.OPEN if BreakerState.OPEN in states else
                 BreakerState.HALF_OPEN if BreakerState.HALF_OPEN in states else BreakerState.CLOSED)
        down = [node.failure for node in nodes if node is not None and not node.reachable]
        num_opened = sum(node.breaker.num_opened for node in topology.all_nodes()) + topology.seeds.num_opened
        with self._lock:
            last_error, refused = down[0] if down else self._last_failure if topology.mode == "unknown" else ("", False)
        return StoreHealth(topology.mode, worst, len(nodes), num_open, self.num_errors, num_opened, last_error, refused)

    def probe(self) -> StoreHealth:
        """Ask every node whether it answers now (the topology first while unknown): one PING each,
        in parallel, within the socket timeout; a node whose breaker is open is not asked until
        it half-opens. Blocking: never on the event loop."""
        if self.topology.slot_table() is not None:
            nodes = [node for node in self.topology.serving_nodes() if node.breaker.allow()]
            for future in [self._parallel.submit(self._ping, node) for node in nodes]:
                future.result()
        return self.health()

    def start_probing(self, interval_s: float) -> None:
        """Probe now, then every `interval_s` on a thread of its own until close()."""
        assert self._prober is None and interval_s > 0
        self.probe()

        def run() -> None:
            while not self._stop_probing.wait(interval_s):
                try:
                    self.probe()
                except Exception:  # a probe must never end the probing
                    log.exception("T3 probe failed")

        self._prober = threading.Thread(target=run, name="kvtierd-t3-probe", daemon=True)
        self._prober.start()

    def close(self) -> None:
        self._stop_probing.set()
        if self._prober is not None:
            self._prober.join()
        self._parallel.shutdown(wait=True)
        for node in self.topology.take_nodes():
            node.client.close()

    # ----------------------------------------------------------------------------- routing

    def _on_each_node(self, groups: dict[StoreNode, list[int]], run: Callable) -> None:
        """`run(node, positions)` for every node whose breaker allows a call, the nodes in parallel."""
        groups = {node: positions for node, positions in groups.items() if node.breaker.allow()}
        if len(groups) == 1:
            run(*next(iter(groups.items())))
        else:
            for future in [self._parallel.submit(run, node, positions) for node, positions in groups.items()]:
                future.result()

    def _ping(self, node: StoreNode) -> None:
        try:
            node.client.ping()
        except (redis.RedisError, OSError) as e:
            self._node_failed(node, e)
        else:
            self._replied(node, [])

    def _seeds_failed(self, error: BaseException) -> None:
        """No seed answered for the slot table: counted, logged."""
        self._failed(endpoint_names(self.config.endpoints), error)
        log.warning("T3 store unreachable at %s: %s", endpoint_names(self.config.endpoints), error)

    def _failed(self, where: str, error: BaseException) -> tuple[str, bool]:
        """Count a failed call; (why it failed, whether the store refused the credentials)."""
        refused = isinstance(error, (redis.AuthenticationError, NoPermissionError))
        why = f"credentials refused ({error})" if refused else (str(error) or type(error).__name__)
        failure = (f"{where}: {why}", refused)
        with self._lock:
            self.num_errors += 1
            self._last_failure = failure
        return failure

    def _node_failed(self, node: StoreNode, error: BaseException) -> None:
        node.failure = self._failed(endpoint_names([node.address]), error)
        node.answering = False
        was_open = node.breaker.state is BreakerState.OPEN
        node.breaker.failed()
        if not was_open and node.breaker.state is BreakerState.OPEN:
            log.warning("T3 node %s:%d failing (%s): its keys are misses for %.0f s", *node.address,
                        type(error).__name__, self.config.breaker_open_s)

    def _replied(self, node: StoreNode, errors: list[redis.RedisError]) -> None:
        """A pipeline came back; `errors` are its error replies. One call is one success or one
        failure for the node's breaker, however many keys it carried."""
        # By class: redis-py strips the reply's code ("MOVED 3999 host:port" is MovedError("3999 host:port")).
        if any(isinstance(e, (AskError, ClusterDownError)) for e in errors):
            self.topology.forget_slots()  # MOVED is an AskError: read the slot table again on the next call
        denied = [e for e in errors if isinstance(e, (NoPermissionError, redis.AuthenticationError))]
        if denied:  # NOPERM, NOAUTH: a credential problem fails the node like a dead one
            self._node_failed(node, denied[0])
        else:
            node.answering = True
            node.breaker.succeeded()
            if errors:
                self._failed(endpoint_names([node.address]), errors[0])
