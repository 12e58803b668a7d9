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
from binascii import crc_hqx
from collections.abc import Callable, Sequence
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.crc import REDIS_CLUSTER_HASH_SLOTS
from redis.exceptions import AskError, ClusterDownError, NoPermissionError
from redis.retry import Retry

from kvtierd.t3.block_frame import FrameValue
from kvtierd.t3.circuit_breaker import BreakerState, CircuitBreaker
from kvtierd.t3.redis_connections import CONNECTION, HIREDIS, TLS_CONNECTION, BulkReader, read_replies
from kvtierd.t3.remote_config import RemoteConfig
from kvtierd.t3.store_node import Address, StoreHealth, StoreNode, endpoint_names

log = logging.getLogger(__name__)
_EXISTS = b"*2\r\n$6\r\nEXISTS\r\n$%d\r\n%s\r\n"  # one EXISTS in RESP, packed by hand
_GET = b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n"
_SMALL = 1 << 14  # a value below this is joined into the write before it


class StoreUnavailable(Exception):
    """The store did not answer a `command` (its message names the node and why, never a value)."""


class RedisStore:
    """Thread-safe. `_slot_nodes` is replaced whole (never mutated) under `_lock`."""

    def __init__(self, config: RemoteConfig, max_parallel_nodes: int = 8) -> None:
        self.config = config
        self.mode = "unknown" if config.mode == "auto" else config.mode
        self._lock = threading.Lock()
        self._nodes: dict[Address, StoreNode] = {}
        self._slot_nodes: list[StoreNode | None] | None = None  # slot → owner; None: not read yet
        self._masters: list[StoreNode] = []  # the distinct owners in the last slot table read
        self._unowned_slots = False  # that table has slots no master serves
        self._seeds = CircuitBreaker(config.breaker_failures, config.breaker_open_s)  # topology reads
        self._parallel = concurrent.futures.ThreadPoolExecutor(max_parallel_nodes, thread_name_prefix="kvtierd-t3")
        self.num_errors = 0
        self._last_failure: tuple[str, bool] = ("", False)  # (what failed, credentials refused)
        self._stop_probing = threading.Event()
        self._prober: threading.Thread | None = None

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

        self._on_each_node(self._group(keys), run)
        return values

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        """Is each key present? Every node's EXISTS go out packed in one write before any reply
        is read (one round trip for all nodes, no thread): redis-py's Pipeline costs ~10 µs a
        command, and a probe of a 4k-token chain is 256 small commands (a Lookup's cost)."""
        present = [False] * len(keys)
        sent = []
        for node, positions in self._group(keys).items():
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

        self._on_each_node(self._group([key for key, _ in items]), run)
        return written

    def command(self, key: bytes, *args: bytes | str) -> Any:
        """One command (`args`: its name, `key` and the rest) on the node that owns `key`, and its
        reply; StoreUnavailable when no node serves the key, its breaker is open or the call fails.
        For the few small records beside the blocks (t3/key_records.py), not for blocks."""
        table = self._slot_table()
        node = None if table is None else self._owner(table, key)
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
        with self._lock:
            table = self._slot_nodes
        if table is None:
            return 0
        down = {node for node in self._serving_nodes() if not node.reachable}
        for position, key in enumerate(keys):
            node = self._owner(table, key)
            if node is None or node in down:
                return position
        return len(keys)

    def all_reachable(self) -> bool:
        """Every slot has a master and every master is known reachable: num_reachable is every key."""
        with self._lock:
            known = self._slot_nodes is not None and not self._unowned_slots
        return known and all(node.reachable for node in self._serving_nodes())

    def health(self) -> StoreHealth:
        nodes = self._serving_nodes()
        states = [node.breaker.state for node in nodes] + [self._seeds.state]
        num_open = sum(not node.reachable for node in nodes)
        if self.mode == "unknown":  # no endpoint answered yet: every seed is unreachable
            num_open = len(self.config.endpoints)
            nodes = [None] * num_open
        worst = (BreakerState.OPEN if BreakerState.OPEN in states else
                 BreakerState.HALF_OPEN if BreakerState.HALF_OPEN in states else BreakerState.CLOSED)
        down = [node.failure for node in nodes if node is not None and not node.reachable]
        with self._lock:
            last_error, refused = down[0] if down else self._last_failure if self.mode == "unknown" else ("", False)
            num_opened = sum(node.breaker.num_opened for node in self._nodes.values()) + self._seeds.num_opened
        return StoreHealth(self.mode, worst, len(nodes), num_open, self.num_errors, num_opened, last_error, refused)

    def probe(self) -> StoreHealth:
        """Ask every node whether it answers now (the topology first while unknown): one PING each,
        in parallel, within the socket timeout; a node whose breaker is open is not asked until
        it half-opens. Blocking: never on the event loop."""
        if self._slot_table() is not None:
            nodes = [node for node in self._serving_nodes() if node.breaker.allow()]
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
        with self._lock:
            nodes, self._nodes = list(self._nodes.values()), {}
        for node in nodes:
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

    def _group(self, keys: Sequence[bytes]) -> dict[StoreNode, list[int]]:
        """Positions of `keys` by the node that owns them; {} while no seed answers."""
        slot_nodes = self._slot_table()
        if slot_nodes is None:
            return {}
        groups: dict[StoreNode, list[int]] = {}
        for position, key in enumerate(keys):
            node = self._owner(slot_nodes, key)
            if node is not None:  # a slot no master serves: a miss
                groups.setdefault(node, []).append(position)
        return groups

    def _owner(self, slot_nodes: list[StoreNode | None], key: bytes) -> StoreNode | None:
        """The node of `key` in a slot table (None: no master serves its slot)."""
        if self.mode == "single":
            return slot_nodes[0]
        # key_slot(key) without its hash-tag search: our keys have none (RemoteConfig, RemoteTier.key)
        return slot_nodes[crc_hqx(key, 0) & (REDIS_CLUSTER_HASH_SLOTS - 1)]

    def _serving_nodes(self) -> list[StoreNode]:
        """The nodes that own slots (every node known while the slot table is unknown)."""
        with self._lock:
            return list(self._nodes.values()) if self._slot_nodes is None else list(self._masters)

    def _ping(self, node: StoreNode) -> None:
        try:
            node.client.ping()
        except (redis.RedisError, OSError) as e:
            self._node_failed(node, e)
        else:
            self._replied(node, [])

    def _slot_table(self) -> list[StoreNode | None] | None:
        with self._lock:
            table = self._slot_nodes
        if table is not None or not self._seeds.allow():
            return table
        try:
            table = self._read_topology()
        except (redis.RedisError, OSError) as e:
            self._seeds.failed()
            self._failed(endpoint_names(self.config.endpoints), e)
            log.warning("T3 store unreachable at %s: %s", endpoint_names(self.config.endpoints), e)
            return None
        self._seeds.succeeded()
        with self._lock:
            self._slot_nodes = table
            self._masters = list({id(node): node for node in table if node is not None}.values())
            self._unowned_slots = None in table
        return table

    def _read_topology(self) -> list[StoreNode | None]:
        """The slot table from the first seed (or known node) that answers."""
        error: Exception | None = None
        with self._lock:
            known = [node.address for node in self._nodes.values()]
        for address in dict.fromkeys([*self.config.endpoints, *known]):
            node = self._node(address)
            try:
                if self.mode == "single":
                    node.client.ping()
                    return [node]
                try:
                    ranges = node.client.execute_command("CLUSTER SLOTS")
                except redis.ResponseError as e:
                    if self.config.mode == "auto" and "cluster support disabled" in str(e).lower():
                        self.mode = "single"
                        return [node]
                    raise
            except (redis.RedisError, OSError) as e:
                error = e
                continue
            self.mode = "cluster"
            table: list[StoreNode | None] = [None] * REDIS_CLUSTER_HASH_SLOTS
            for first, last, master, *_ in ranges or ():
                host = master[0].decode() if isinstance(master[0], bytes) else master[0]
                owner = self._node((host or address[0], int(master[1])))
                table[first:last + 1] = [owner] * (last - first + 1)
            return table
        raise error or redis.ConnectionError("no endpoints")

    def _node(self, address: Address) -> StoreNode:
        with self._lock:
            node = self._nodes.get(address)
            if node is None:
                node = self._nodes[address] = StoreNode(address, self._client(address), CircuitBreaker(
                    self.config.breaker_failures, self.config.breaker_open_s))
            return node

    def _client(self, address: Address) -> redis.Redis:
        config = self.config
        options: dict[str, Any] = dict(host=address[0], port=address[1], username=config.username or None,
                       password=config.password or None, socket_timeout=config.timeout_s,
                       socket_connect_timeout=config.timeout_s, retry=Retry(NoBackoff(), 0),
                       socket_read_size=1 << 20)
        if config.tls:
            options.update(ssl_ca_certs=config.tls_ca_file or None, ssl_certfile=config.tls_cert_file or None,
                           ssl_keyfile=config.tls_key_file or None)
        connection_class = TLS_CONNECTION if config.tls else CONNECTION
        return redis.Redis(connection_pool=redis.ConnectionPool(connection_class=connection_class, **options))

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
            with self._lock:  # MOVED is an AskError
                self._slot_nodes = None  # read the slot table again on the next call
        denied = [e for e in errors if isinstance(e, (NoPermissionError, redis.AuthenticationError))]
        if denied:  # NOPERM, NOAUTH: a credential problem fails the node like a dead one
            self._node_failed(node, denied[0])
        else:
            node.answering = True
            node.breaker.succeeded()
            if errors:
                self._failed(endpoint_names([node.address]), errors[0])
