"""Which store node owns which key: the nodes met so far and the slot table read from a seed.

A Redis Cluster's slot table comes from CLUSTER SLOTS on the first seed (or known node) that answers;
a single Redis / Valkey is one node owning every key (`remote.mode` single, or auto on a node whose
cluster support is off). The table is read on first use and again after `forget_slots` (a MOVED or
CLUSTERDOWN reply); reads go through the seeds' circuit breaker, and a failed read reports itself
through `on_seeds_failed` and gives no table (every key a miss).
"""

from __future__ import annotations

import threading
from binascii import crc_hqx
from collections.abc import Callable, Sequence
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.crc import REDIS_CLUSTER_HASH_SLOTS
from redis.retry import Retry

from kvtierd.t3.circuit_breaker import CircuitBreaker
from kvtierd.t3.redis_connections import CONNECTION, TLS_CONNECTION
from kvtierd.t3.remote_config import RemoteConfig
from kvtierd.t3.store_node import Address, StoreNode

SlotTable = list[StoreNode | None]  # slot → the master that serves it (None: none does)


class ClusterTopology:
    """Thread-safe. `_slot_nodes` is replaced whole (never mutated) under `_lock`; `mode` is "unknown"
    until a seed answered (with `remote.mode` auto), then "cluster" or "single"."""

    def __init__(self, config: RemoteConfig, on_seeds_failed: Callable[[BaseException], None]) -> None:
        self.config = config
        self.mode = "unknown" if config.mode == "auto" else config.mode
        self.seeds = CircuitBreaker(config.breaker_failures, config.breaker_open_s)  # topology reads
        self._on_seeds_failed = on_seeds_failed
        self._lock = threading.Lock()
        self._nodes: dict[Address, StoreNode] = {}
        self._slot_nodes: SlotTable | None = None  # None: not read yet
        self._masters: list[StoreNode] = []  # the distinct owners in the last slot table read
        self._unowned_slots = False  # that table has slots no master serves

    def slot_table(self) -> SlotTable | None:
        """The slot table, read now if unknown and the seeds' breaker allows; None: no seed answered."""
        with self._lock:
            table = self._slot_nodes
        if table is not None or not self.seeds.allow():
            return table
        try:
            table = self._read()
        except (redis.RedisError, OSError) as e:
            self.seeds.failed()
            self._on_seeds_failed(e)
            return None
        self.seeds.succeeded()
        with self._lock:
            self._slot_nodes = table
            self._masters = list({id(node): node for node in table if node is not None}.values())
            self._unowned_slots = None in table
        return table

    def known_table(self) -> SlotTable | None:
        """The slot table as last read, without reading it (None: unknown)."""
        with self._lock:
            return self._slot_nodes

    def complete(self) -> bool:
        """A slot table is known and a master serves every slot."""
        with self._lock:
            return self._slot_nodes is not None and not self._unowned_slots

    def forget_slots(self) -> None:
        """Slots moved: read the table again on the next call."""
        with self._lock:
            self._slot_nodes = None

    def group(self, keys: Sequence[bytes]) -> dict[StoreNode, list[int]]:
        """Positions of `keys` by the node that owns them; {} while no seed answers."""
        slot_nodes = self.slot_table()
        if slot_nodes is None:
            return {}
        groups: dict[StoreNode, list[int]] = {}
        for position, key in enumerate(keys):
            node = self.owner(slot_nodes, key)
            if node is not None:  # a slot no master serves: a miss
                groups.setdefault(node, []).append(position)
        return groups

    def owner(self, slot_nodes: SlotTable, key: bytes) -> StoreNode | None:
        """The node of `key` in a slot table (None: no master serves its slot)."""
        if self.mode == "single":
            return slot_nodes[0]
        # key_slot(key) without its hash-tag search: our keys have none (RemoteConfig, RemoteTier.key)
        return slot_nodes[crc_hqx(key, 0) & (REDIS_CLUSTER_HASH_SLOTS - 1)]

    def serving_nodes(self) -> list[StoreNode]:
        """The nodes that own slots (every node known while the slot table is unknown)."""
        with self._lock:
            return list(self._nodes.values()) if self._slot_nodes is None else list(self._masters)

    def all_nodes(self) -> list[StoreNode]:
        with self._lock:
            return list(self._nodes.values())

    def take_nodes(self) -> list[StoreNode]:
        """Every node known, forgotten here (closing: the caller closes their clients)."""
        with self._lock:
            nodes, self._nodes = list(self._nodes.values()), {}
        return nodes

    def _read(self) -> SlotTable:
        """The slot table from the first seed (or known node) that answers."""
        error: Exception | None = None
        for address in dict.fromkeys([*self.config.endpoints, *(node.address for node in self.all_nodes())]):
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
            table: SlotTable = [None] * REDIS_CLUSTER_HASH_SLOTS
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
                node = self._nodes[address] = StoreNode(address, node_client(self.config, address), CircuitBreaker(
                    self.config.breaker_failures, self.config.breaker_open_s))
            return node


def node_client(config: RemoteConfig, address: Address) -> redis.Redis:
    """A redis-py client of one node: the store's credentials and TLS, no retries (the breakers decide)."""
    options: dict[str, Any] = dict(host=address[0], port=address[1], username=config.username or None,
                                   password=config.password or None, socket_timeout=config.timeout_s,
                                   socket_connect_timeout=config.timeout_s, retry=Retry(NoBackoff(), 0),
                                   socket_read_size=1 << 20)
    if config.tls:
        options.update(ssl_ca_certs=config.tls_ca_file or None, ssl_certfile=config.tls_cert_file or None,
                       ssl_keyfile=config.tls_key_file or None)
    connection_class = TLS_CONNECTION if config.tls else CONNECTION
    return redis.Redis(connection_pool=redis.ConnectionPool(connection_class=connection_class, **options))
