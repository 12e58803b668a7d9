"""`kvtierd serve`: the daemon process.

One asyncio event loop (uvloop where installed) runs grpc.aio with the KvTier service, the
standard health service and server reflection; copy engines run on their own threads; the
Prometheus endpoint on its own port. Listens on a unix socket (mode 0600, or server.socket_mode
and socket_group) by default, with its fd socket beside it (`<socket>.fds`, fd_listener.py: the
device pool's descriptor for attached runners), and on TCP with TLS (optionally requiring client
certificates) when configured.

Start: the configuration is checked against the machine (startup_checks.py), then every
listener is bound (ports first, the unix socket last), then the SSD directory is locked
(t2/directory_lock.py), then the servers start and `ready` is printed. A mistake at any step is one
KvtierError naming the setting (kvtierd_main prints it as one line and exits 2), and `stop()`
releases only what this daemon acquired: it never unlinks a socket or lock of another daemon.

SIGTERM or SIGINT: health turns NOT_SERVING, the server stops accepting and gives in-flight
calls `grace_s`, sessions are closed (their blocks released), every pool drains its in-flight
moves and flushes its T2 index, the socket file is removed (if still ours), the SSD directory
lock is released, and the process exits 0.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
from collections.abc import Callable
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvtierd.errors import FailedPrecondition
from kvtierd.events.event_feed import EventFeed
from kvtierd.events.vllm_events import BatchEncoder, WireFormat
from kvtierd.events.zmq_publisher import ZmqEventPublisher
from kvtierd.metrics.daemon_metrics import DaemonMetrics
from kvtierd.node.operations import Operations
from kvtierd.node.pools import PoolRegistry, PoolSettings
from kvtierd.node.quotas import QuotaBook
from kvtierd.node.sessions import SessionTable
from kvtierd.node.tenants import Authenticator, TokenBook
from kvtierd.planning.capacity import format_bytes
from kvtierd.server.config_flags import setting_name
from kvtierd.server.config_summary import config_lines, planning_lines
from kvtierd.server.daemon_config import DaemonConfig
from kvtierd.server.encryption_setup import NodeKeys, node_keys
from kvtierd.server.fd_listener import FdListener
from kvtierd.server.heap_settings import keep_block_buffers_in_heap
from kvtierd.server.interceptor import StatusInterceptor
from kvtierd.server.listeners import SocketFile, add_port, apply_socket_access, bind_fd_socket, bind_unix_socket
from kvtierd.server.server_config import ServerConfig, admin_tenant_names
from kvtierd.server.servicer import KvTierServicer
from kvtierd.server.ssd_state import SsdHealth, no_room_problem, node_ssd_message, off_by_choice
from kvtierd.server.startup_checks import check_machine, socket_group_id
from kvtierd.t0.shm_segment import remove_orphaned_segments
from kvtierd.t2.directory_lock import DirectoryLock
from kvtierd.tiering.tier_config import TierConfig
from kvtierd.v1 import kvtier_pb2
from kvtierd.wire.conversions import READ_CHUNK_OPTIONS
from kvtierd.wire.fd_passing import fd_socket_path

if TYPE_CHECKING:  # the registry imports the store's client only where T3 is on
    from kvtierd.t2.ssd_probe import DirectoryProbe
    from kvtierd.t3.redis_store import RedisStore

log = logging.getLogger("kvtierd")
RETENTION_SWEEP_S = 1.0  # how often expired retention hints are forgotten (a lapsed hint is not live meanwhile)

SERVICE_NAME = kvtier_pb2.DESCRIPTOR.services_by_name["KvTier"].full_name
STORE_HEALTH_NAME = "kvtierd.v1.SharedStore"  # a health service name: SERVING while every T3 node answers


def pool_settings(config: DaemonConfig, keys: NodeKeys | None = None) -> PoolSettings:
    """The pools' settings: the daemon's sections, T2 and T3 only where on (reads the T3 password file),
    the node's data keys where encryption is on.
    A daemon without its unix socket has no fd socket to pass a CUDA pool's descriptor over: its CUDA
    pools are shared by IPC handle (config_summary says so)."""
    pool = config.pool if config.server.socket else dataclasses.replace(config.pool, cuda_share="ipc")
    return PoolSettings(pool, TierConfig.of_sections(config.host, config.ssd, config.policy, config.remote,
                                                      config.retention),
                        ssd=config.ssd if config.ssd.enabled else None,
                        remote=config.remote.with_password_read() if config.remote.enabled else None,
                        tenant_keys=keys.tenant_keys if keys is not None else None,
                        master_key=keys.master if keys is not None else None,
                        t2_max_age_s=config.retention.max_age_s)


class Daemon:
    """The server and everything it owns; `start()` binds, `stop()` shuts down in order.

    `socket_file` and `ssd_lock` are set once start has acquired them; `stop()` releases what is
    set, so it is right after a start that failed half way too.
    """

    def __init__(self, config: DaemonConfig) -> None:
        self.config = config
        server_config = config.server
        self.metrics = DaemonMetrics()
        tokens = TokenBook.load(server_config.tokens_file) if server_config.tokens_file else None
        self.authenticator = Authenticator(tokens)
        quotas = QuotaBook(config.quotas)
        self.keys = node_keys(config)  # where encryption is on: the master key read and checked now
        self.registry = PoolRegistry(pool_settings(config, self.keys), self.metrics.index_observer, quotas)
        self.registry.on_created.append(lambda pool: self.metrics.add_pool_source(
            pool.layout.model_id, pool.layout.block_size, pool.layout.bytes_per_block, pool.manager.stats))
        if self.registry.remote_store is not None:
            self.metrics.add_store_source(self.registry.remote_store.health)
        self.sessions = SessionTable(server_config.lease_s, quotas, self.metrics.session_opened,
                                     self.metrics.session_closed)
        known = [self.authenticator.socket_tenant.name, *config.quotas]
        if tokens is not None:
            known += tokens.tenant_names()
        self.operations = Operations(self.registry, self.sessions, admin_tenant_names(server_config), known,
                                     self.keys.tenant_keys if self.keys is not None else None)
        self.publisher = kv_event_publisher(config, self.operations.name_of)
        self.feed = EventFeed(self.registry, publisher=self.publisher, lower_tiers=config.events.lower_tiers)
        self.registry.on_created.append(self.feed.watch)
        self.metrics.add_tenant_source(self.operations.usage_rows, quotas.limits)
        # health.py imports its asyncio servicer as `aio`, an alias pyright does not take for an export
        self.health = health.aio.HealthServicer()  # pyright: ignore[reportAttributeAccessIssue]
        self.server: grpc.aio.Server | None = None
        self.health_server: grpc.aio.Server | None = None  # plaintext, health only (server.health_tcp)
        self.health_address: str | None = None
        self.servicer: KvTierServicer | None = None
        self.addresses: list[str] = []
        self.metrics_port: int | None = None
        self.socket_file: SocketFile | None = None  # the unix socket this daemon bound
        self.fd_socket_file: SocketFile | None = None  # its fd socket, `<socket>.fds`
        self.fd_listener: FdListener | None = None  # serves the fd socket once started
        self.ssd_lock: DirectoryLock | None = None  # held on ssd.directory while T2 is on
        self.ssd_probe: DirectoryProbe | None = None  # what start-up found in ssd.directory (None: T2 off)
        self.ssd_problem = ""  # why the node runs without the T2 it wants (ssd_state.py)
        self._tasks: list[asyncio.Task] = []
        self._stopped = asyncio.Event()

    async def start(self) -> None:
        self.ssd_probe = check_machine(self.config)
        self.ssd_problem = no_room_problem(self.config)
        if self.ssd_problem:
            log.warning("running without T2: %s", self.ssd_problem)
        server_config = self.config.server
        if self.publisher is not None:
            try:
                self.publisher.start()
            except OSError as e:
                raise FailedPrecondition(f"cannot publish KV events: {e.strerror}; see the [events] section") from None
        limit = server_config.max_message_bytes
        self.server = server = grpc.aio.server(
            interceptors=[StatusInterceptor(self.authenticator, self.metrics.observe_rpc)],
            options=[("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit),
                     ("grpc.so_reuseport", 0), *READ_CHUNK_OPTIONS])
        self.servicer = KvTierServicer(self.registry, self.sessions, self.feed, operations=self.operations,
                                       on_drain=self._set_serving)
        self.servicer.node_ssd = node_ssd_message(self.config, self.ssd_problem, self.ssd_probe)
        server.add_generic_rpc_handlers((kvtier_handlers(self.servicer),))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection([SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
        if server_config.tcp:
            port = self._add_tcp_port(server, server_config)
            host = server_config.tcp.rsplit(":", 1)[0]
            self.addresses.append(f"{host}:{port}")
        if server_config.health_tcp:
            self._add_health_listener(server_config.health_tcp)
        if server_config.metrics_port >= 0:
            self._serve_metrics(server_config.metrics_host, server_config.metrics_port)
        if server_config.socket:  # last: a refused port leaves no socket file behind
            self.socket_file = bind_unix_socket(server, server_config.socket, setting_name("server.socket"))
            self.addresses.append("unix://" + server_config.socket)
            listening, self.fd_socket_file = bind_fd_socket(fd_socket_path(server_config.socket),
                                                            setting_name("server.socket"))
            self.fd_listener = FdListener(listening)
            self.servicer.fd_listener = self.fd_listener
        ssd = self.config.ssd
        if ssd.enabled:  # before any pool opens T2 in it
            self.ssd_lock = DirectoryLock.acquire(ssd.directory, setting_name("ssd.directory"))
        if self.keys is not None:  # under the lock: one daemon claims the key directory
            self.keys.claim()
            log.info("encryption: %s", self.keys.describe(with_t3=self.registry.remote_keys is not None))
        num_orphans, orphan_bytes = remove_orphaned_segments()  # what killed daemons left in /dev/shm
        if num_orphans:
            log.warning("removed %d shared-memory segments (%s) that killed kvtierd processes left in /dev/shm",
                        num_orphans, format_bytes(orphan_bytes))
        await server.start()
        if self.health_server is not None:
            await self.health_server.start()
        if server_config.socket:
            self._apply_socket_access(server_config)
        if self.fd_listener is not None:  # bound with the unix socket
            self.fd_listener.start()
        await self._set_serving(False)
        self._tasks = [asyncio.create_task(self.sessions.run_reaper(min(1.0, server_config.lease_s / 4))),
                       asyncio.create_task(self.feed.run()), asyncio.create_task(self._sweep_retention())]
        if not off_by_choice(self.config):  # T2's health known before ready, then followed
            ssd_health = SsdHealth(self.health, self.config, self.ssd_problem, self.registry.pools)
            await ssd_health.update()
            self._tasks.append(asyncio.create_task(ssd_health.follow()))
        store = self.registry.remote_store
        if store is not None:  # probed before ready: a healthy store is serving from the first second
            await asyncio.to_thread(store.start_probing, store.config.probe_interval_s)
            self._tasks.append(asyncio.create_task(self._follow_store(store)))

    def _apply_socket_access(self, server_config: ServerConfig) -> None:
        """server.socket_group and socket_mode on both sockets; directories made for them get the
        group and the search bit of whom the mode lets connect."""
        assert self.socket_file is not None and self.fd_socket_file is not None, "bound by start"
        group_id = socket_group_id(server_config.socket_group) if server_config.socket_group else None
        mode = int(server_config.socket_mode, 8)
        for path in (server_config.socket, self.fd_socket_file.path):
            apply_socket_access(path, group_id, mode)
        directory_mode = 0o700 | (0o010 if mode & 0o060 else 0) | (0o001 if mode & 0o006 else 0)
        for directory in self.socket_file.created_directories:
            apply_socket_access(directory, group_id, directory_mode)

    def _add_health_listener(self, address: str) -> None:
        """grpc.health.v1 alone, in the clear: Kubernetes' gRPC probes cannot speak TLS, and the
        health status is all this listener reveals. Bound here, started with the server."""
        self.health_server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.health_server)
        port = add_port(self.health_server, address, setting_name("server.health_tcp"))
        self.health_address = f"{address.rsplit(':', 1)[0]}:{port}"

    def _serve_metrics(self, host: str, port: int) -> None:
        try:
            _, self.metrics_port = self.metrics.serve_http(host, port)
        except OSError as e:
            raise FailedPrecondition(f"cannot serve metrics on {host}:{port}: {e.strerror}; choose another "
                                     f"{setting_name('server.metrics_port')} (0: any free port, -1: none)") from None

    async def _set_serving(self, draining: bool, stopping: bool = False) -> None:
        """Health of kvtierd.v1.KvTier (readiness: engines and load balancers stop sending) is
        NOT_SERVING while draining or stopping; of "" (liveness: the process serves) only while
        stopping, so that a probe does not restart a daemon an operator is draining."""
        serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
        await self.health.set(SERVICE_NAME, not_serving if draining or stopping else serving)
        await self.health.set("", not_serving if stopping else serving)

    async def _sweep_retention(self) -> None:
        """Forget expired retention hints, give back lapsed Lookup holds and drop T2 blocks past
        retention.max_age_s every RETENTION_SWEEP_S, on a thread (the tiers' locks)."""
        while True:
            await asyncio.sleep(RETENTION_SWEEP_S)
            await asyncio.to_thread(self._sweep_pools)

    def _sweep_pools(self) -> None:
        for pool in self.registry.pools():
            pool.manager.retention.sweep()
            pool.manager.lookup_holds.expire()
            if (ssd := pool.manager.tiers.ssd) is not None:
                ssd.drops.expire_aged()  # retention.max_age_s

    async def _follow_store(self, store: RedisStore) -> None:
        """Health of STORE_HEALTH_NAME from the store's probes (health() only reads their results)."""
        serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
        while True:
            await self.health.set(STORE_HEALTH_NAME, serving if store.health().serving else not_serving)
            await asyncio.sleep(store.config.probe_interval_s / 2)

    def _add_tcp_port(self, server: grpc.aio.Server, server_config: ServerConfig) -> int:
        if server_config.tls_cert:
            with open(server_config.tls_cert, "rb") as f:
                cert = f.read()
            with open(server_config.tls_key, "rb") as f:
                key = f.read()
            client_ca = None
            if server_config.tls_client_ca:
                with open(server_config.tls_client_ca, "rb") as f:
                    client_ca = f.read()
            credentials = grpc.ssl_server_credentials([(key, cert)], root_certificates=client_ca,
                                                      require_client_auth=client_ca is not None)
            return add_port(server, server_config.tcp, setting_name("server.tcp"), credentials)
        return add_port(server, server_config.tcp, setting_name("server.tcp"))

    def startup_lines(self) -> list[str]:
        lines = [f"kvtierd: listening on {address}" for address in self.addresses]
        if self.fd_socket_file is not None:
            server = self.config.server
            lines.append(f"kvtierd: pool descriptors on unix://{self.fd_socket_file.path} (sockets mode "
                         f"{server.socket_mode}, group {server.socket_group or os.getgid()})")
        if self.health_address is not None:
            lines.append(f"kvtierd: health checks on {self.health_address}")
        if self.metrics_port is not None:
            lines.append(f"kvtierd: metrics on http://{self.config.server.metrics_host}:{self.metrics_port}/metrics")
        if self.publisher is not None:
            lines.append(f"kvtierd: kv events on {self.publisher.endpoint}")
            if self.publisher.replay_endpoint:
                lines.append(f"kvtierd: kv event replay on {self.publisher.replay_endpoint}")
        lines.append(f"kvtierd: tenants from {self.authenticator.describe()}")
        if self.ssd_probe is not None and self.ssd_probe.o_direct_refused:
            lines.append(f"kvtierd: T2 in {self.config.ssd.directory} uses buffered I/O: "
                         f"{self.ssd_probe.o_direct_refused}")
        return config_lines(self.config) + planning_lines(self.config) + lines

    def request_stop(self) -> None:
        self._stopped.set()

    async def wait(self) -> None:
        await self._stopped.wait()

    async def stop(self) -> None:
        await self._set_serving(True, stopping=True)
        if self.servicer is not None:
            self.servicer.begin_shutdown()
        if self.server is not None:
            await self.server.stop(self.config.server.grace_s)
        if self.fd_listener is not None:  # before the pools whose descriptors it hands out close
            await self.fd_listener.stop()
        if self.health_server is not None:
            await self.health_server.stop(0)
        for task in self._tasks:
            task.cancel()
        if self.publisher is not None:
            self.feed.pump_once()  # what the last sessions' releases changed
            await asyncio.to_thread(self.publisher.stop)
        num_refs = await self.sessions.close_all()
        if num_refs:
            log.info("released %d block references of sessions open at shutdown", num_refs)
        await asyncio.to_thread(self.registry.close)
        self.metrics.close()
        if self.fd_socket_file is not None:
            self.fd_socket_file.remove()
            self.fd_socket_file = None
        if self.socket_file is not None:
            self.socket_file.remove()
            self.socket_file = None
        if self.ssd_lock is not None:
            self.ssd_lock.release()
            self.ssd_lock = None


def kv_event_publisher(config: DaemonConfig, tenant_name: Callable[[bytes], str]) -> ZmqEventPublisher | None:
    """The [events] section's ZMQ publisher (not started), or None when it is off."""
    events = config.events
    if not events.zmq_endpoint:
        return None
    wire = WireFormat(format=events.format, int_block_hashes=events.int_block_hashes, salt=events.salt)
    return ZmqEventPublisher(BatchEncoder(wire, tenant_name), events.zmq_endpoint, events.replay_endpoint,
                             events.topic, events.buffer_steps, events.max_queued_events, events.connect)


def kvtier_handlers(servicer: KvTierServicer) -> grpc.GenericRpcHandler:
    """The KvTier methods with their protobuf (de)serializers, except the block bytes: Put's
    requests arrive serialized and Get's responses leave serialized (block_frames.py), so a
    block is not copied through protobuf objects."""
    service = kvtier_pb2.DESCRIPTOR.services_by_name["KvTier"]
    handlers = {}
    for method in service.methods:
        kind = _HANDLER_KINDS[method.client_streaming, method.server_streaming]
        request = getattr(kvtier_pb2, method.input_type.name)
        response = getattr(kvtier_pb2, method.output_type.name)
        handlers[method.name] = kind(getattr(servicer, method.name),
                                     request_deserializer=None if method.name == "Put" else request.FromString,
                                     response_serializer=None if method.name == "Get" else response.SerializeToString)
    return grpc.method_handlers_generic_handler(service.full_name, handlers)


_HANDLER_KINDS = {(False, False): grpc.unary_unary_rpc_method_handler,
                  (True, False): grpc.stream_unary_rpc_method_handler,
                  (False, True): grpc.unary_stream_rpc_method_handler,
                  (True, True): grpc.stream_stream_rpc_method_handler}


async def serve(config: DaemonConfig, print_line: Callable[[str], object] = print) -> int:
    daemon = Daemon(config)
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, daemon.request_stop)
    try:
        await daemon.start()
        for line in daemon.startup_lines():
            print_line(line)
        print_line("kvtierd: ready")
        await daemon.wait()
        print_line("kvtierd: stopping")
    finally:
        await daemon.stop()
    print_line("kvtierd: stopped")
    return 0


def run(config: DaemonConfig) -> int:
    """Run the daemon until SIGTERM/SIGINT on uvloop (plain asyncio where uvloop is missing)."""
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    keep_block_buffers_in_heap()
    try:
        import uvloop
        loop_factory = uvloop.new_event_loop
    except ImportError:
        loop_factory = None
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        return runner.run(serve(config, lambda line: print(line, flush=True)))
