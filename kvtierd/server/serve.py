"""`kvtierd serve`: the daemon process.

One asyncio event loop (uvloop where installed) runs grpc.aio with the KvTier service, the
standard health service and server reflection; copy engines run on their own threads; the
Prometheus endpoint on its own port. Listens on a unix socket (mode 0600) by default and on
TCP with TLS (optionally requiring client certificates) when configured.

Start: the configuration is checked against the machine (startup_checks.py), then every
listener is bound (ports first, the unix socket last), then the SSD directory is locked
(directory_lock.py), then the servers start and `ready` is printed. A mistake at any step is one
KvtierError naming the setting (kvtierd_main prints it as one line and exits 2), and `stop()`
releases only what this daemon acquired: it never unlinks a socket or lock of another daemon.

SIGTERM or SIGINT: health turns NOT_SERVING, the server stops accepting and gives in-flight
calls `grace_s`, sessions are closed (their blocks released), every pool drains its in-flight
moves and flushes its T2 index, the socket file is removed (if still ours), the SSD directory
lock is released, and the process exits 0.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvtierd.errors import FailedPrecondition
from kvtierd.layout import llama3_8b
from kvtierd.metrics.daemon_metrics import DaemonMetrics
from kvtierd.node.config_summary import config_lines
from kvtierd.node.daemon_config import DaemonConfig, admin_tenant_names, setting_name
from kvtierd.node.operations import Operations
from kvtierd.node.pools import PoolRegistry, PoolSettings
from kvtierd.node.quotas import QuotaBook
from kvtierd.node.remote_section import remote_config_of
from kvtierd.node.sessions import SessionTable
from kvtierd.node.tenants import Authenticator, TokenBook
from kvtierd.planning.capacity import PoolCapacity
from kvtierd.server.directory_lock import DirectoryLock
from kvtierd.server.event_feed import EventFeed
from kvtierd.server.interceptor import StatusInterceptor
from kvtierd.server.listeners import SocketFile, add_port, bind_unix_socket
from kvtierd.server.servicer import KvTierServicer
from kvtierd.server.startup_checks import check_machine
from kvtierd.server.vllm_events import BatchEncoder, WireFormat
from kvtierd.server.zmq_publisher import ZmqEventPublisher
from kvtierd.tiering.tier_config import TierConfig
from kvtierd.v1 import kvtier_pb2
from kvtierd.wire.conversions import READ_CHUNK_OPTIONS

log = logging.getLogger("kvtierd")

SERVICE_NAME = kvtier_pb2.DESCRIPTOR.services_by_name["KvTier"].full_name


def pool_settings(config: DaemonConfig) -> PoolSettings:
    policy = config.policy
    tier_config = TierConfig(host_capacity_bytes=config.host.capacity_bytes, host_codec=config.host.codec,
                             ssd_codec=config.ssd.codec, t0_to_t1=policy.t0_to_t1, t1_to_t2=policy.t1_to_t2,
                             t1_to_t3=policy.t1_to_t3, t2_to_t3=policy.t2_to_t3, remote_codec=config.remote.codec,
                             recompute_s_per_token=policy.recompute_s_per_token or None)
    return PoolSettings(t0_bytes=config.pool.t0_bytes, tier_config=tier_config, device=config.pool.device,
                        hash_algo=config.pool.hash_algo, ssd_directory=config.ssd.directory,
                        ssd_capacity_bytes=config.ssd.capacity_bytes, ssd_durability=config.ssd.durability,
                        ssd_o_direct=config.ssd.o_direct, max_layouts=config.pool.max_layouts,
                        remote=remote_config_of(config.remote))


def planning_lines(config: DaemonConfig, request_tokens: int = 8192) -> list[str]:
    """Capacity lines for a reference layout (Llama-3-8B fp16, block 16); each attached layout
    prints its own when its pool is created."""
    layout = llama3_8b()
    lines = [f"capacity per layout, planned for {layout.model_id} "
             f"({layout.bytes_per_token // 1024} KiB per token, {layout.bytes_per_block // 2**20} MiB per block):"]
    lines += PoolCapacity.from_budget(layout, config.pool.t0_bytes).lines("  T0 device pool", request_tokens)
    if config.host.capacity_bytes:
        lines.append(PoolCapacity.from_budget(layout, config.host.capacity_bytes).lines("  T1 host", request_tokens)[0])
    if config.ssd.directory and config.ssd.capacity_bytes:
        lines.append(PoolCapacity.from_budget(layout, config.ssd.capacity_bytes).lines("  T2 SSD", request_tokens)[0])
    return lines


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
        self.registry = PoolRegistry(pool_settings(config), self.metrics.index_observer, quotas)
        self.registry.on_created.append(lambda pool: self.metrics.add_pool_source(
            pool.layout.model_id, pool.layout.block_size, pool.layout.bytes_per_block, pool.manager.stats))
        if self.registry.remote_store is not None:
            self.metrics.add_store_source(self.registry.remote_store.health)
        self.sessions = SessionTable(server_config.lease_s, quotas, self.metrics.session_opened,
                                     self.metrics.session_closed)
        known = [self.authenticator.socket_tenant.name, *config.quotas]
        if tokens is not None:
            known += tokens.tenant_names()
        self.operations = Operations(self.registry, self.sessions, admin_tenant_names(server_config), known)
        self.publisher = kv_event_publisher(config, self.operations.name_of)
        self.feed = EventFeed(self.registry, publisher=self.publisher, lower_tiers=config.events.lower_tiers)
        self.registry.on_created.append(self.feed.enable_lower_tiers)
        self.metrics.add_tenant_source(self.operations.usage_rows, quotas.limits)
        self.health = health.aio.HealthServicer()
        self.server: grpc.aio.Server | None = None
        self.health_server: grpc.aio.Server | None = None  # plaintext, health only (server.health_tcp)
        self.health_address: str | None = None
        self.servicer: KvTierServicer | None = None
        self.addresses: list[str] = []
        self.metrics_port: int | None = None
        self.socket_file: SocketFile | None = None  # the unix socket this daemon bound
        self.ssd_lock: DirectoryLock | None = None  # held on ssd.directory while T2 is on
        self._tasks: list[asyncio.Task] = []
        self._stopped = asyncio.Event()

    async def start(self) -> None:
        check_machine(self.config)
        server_config = self.config.server
        if self.publisher is not None:
            try:
                self.publisher.start()
            except OSError as e:
                raise FailedPrecondition(f"cannot publish KV events: {e.strerror}; see the [events] section") from None
        limit = server_config.max_message_bytes
        self.server = grpc.aio.server(
            interceptors=[StatusInterceptor(self.authenticator, self.metrics.observe_rpc)],
            options=[("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit),
                     ("grpc.so_reuseport", 0), *READ_CHUNK_OPTIONS])
        self.servicer = KvTierServicer(self.registry, self.sessions, self.feed, operations=self.operations,
                                       on_drain=self._set_serving)
        self.server.add_generic_rpc_handlers((kvtier_handlers(self.servicer),))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection([SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME], self.server)
        if server_config.tcp:
            port = self._add_tcp_port(server_config)
            host = server_config.tcp.rsplit(":", 1)[0]
            self.addresses.append(f"{host}:{port}")
        if server_config.health_tcp:
            self._add_health_listener(server_config.health_tcp)
        if server_config.metrics_port >= 0:
            self._serve_metrics(server_config.metrics_host, server_config.metrics_port)
        if server_config.socket:  # last: a refused port leaves no socket file behind
            self.socket_file = bind_unix_socket(self.server, server_config.socket, setting_name("server.socket"))
            self.addresses.append("unix://" + server_config.socket)
        ssd = self.config.ssd
        if ssd.directory and ssd.capacity_bytes:  # before any pool opens T2 in it
            self.ssd_lock = DirectoryLock.acquire(ssd.directory, setting_name("ssd.directory"))
        await self.server.start()
        if self.health_server is not None:
            await self.health_server.start()
        if server_config.socket:
            os.chmod(server_config.socket, 0o600)
        await self._set_serving(False)
        self._tasks = [asyncio.create_task(self.sessions.run_reaper(min(1.0, server_config.lease_s / 4))),
                       asyncio.create_task(self.feed.run())]

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

    async def _set_serving(self, draining: bool) -> None:
        """Health SERVING, or NOT_SERVING while draining (load balancers and probes stop sending)."""
        status = health_pb2.HealthCheckResponse.NOT_SERVING if draining else health_pb2.HealthCheckResponse.SERVING
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)

    def _add_tcp_port(self, server_config) -> int:
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
            return add_port(self.server, server_config.tcp, setting_name("server.tcp"), credentials)
        return add_port(self.server, server_config.tcp, setting_name("server.tcp"))

    def startup_lines(self) -> list[str]:
        lines = [f"kvtierd: listening on {address}" for address in self.addresses]
        if self.health_address is not None:
            lines.append(f"kvtierd: health checks on {self.health_address}")
        if self.metrics_port is not None:
            lines.append(f"kvtierd: metrics on http://{self.config.server.metrics_host}:{self.metrics_port}/metrics")
        if self.publisher is not None:
            lines.append(f"kvtierd: kv events on {self.publisher.endpoint}")
            if self.publisher.replay_endpoint:
                lines.append(f"kvtierd: kv event replay on {self.publisher.replay_endpoint}")
        lines.append(f"kvtierd: tenants from {self.authenticator.describe()}")
        return config_lines(self.config) + planning_lines(self.config) + lines

    def request_stop(self) -> None:
        self._stopped.set()

    async def wait(self) -> None:
        await self._stopped.wait()

    async def stop(self) -> None:
        await self._set_serving(True)
        if self.servicer is not None:
            self.servicer.begin_shutdown()
        if self.server is not None:
            await self.server.stop(self.config.server.grace_s)
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
        if self.socket_file is not None:
            self.socket_file.remove()
            self.socket_file = None
        if self.ssd_lock is not None:
            self.ssd_lock.release()
            self.ssd_lock = None


def kv_event_publisher(config: DaemonConfig, tenant_name) -> ZmqEventPublisher | None:
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


async def serve(config: DaemonConfig, print_line=print) -> int:
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
    try:
        import uvloop
        loop_factory = uvloop.new_event_loop
    except ImportError:
        loop_factory = None
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        return runner.run(serve(config, lambda line: print(line, flush=True)))
