"""The daemon file's [server] section: the listeners (unix socket, TCP with TLS, the health-only
port, metrics), who is a tenant and who an admin, sessions and shutdown. No torch, no grpc here."""

from __future__ import annotations

import dataclasses
import os
import re

from kvtierd.config_checks import require
from kvtierd.endpoints import default_socket_path
from kvtierd.units import MiB


@dataclasses.dataclass(frozen=True, slots=True)
class ServerConfig:
    socket: str = dataclasses.field(default_factory=default_socket_path)  # unix socket path; "" = none
    tcp: str = ""  # "host:port" to listen on TCP as well ("127.0.0.1:0": a free port); "" = none
    tls_cert: str = ""  # PEM certificate chain for TCP; set with tls_key, or neither
    tls_key: str = ""  # PEM private key of tls_cert
    tls_client_ca: str = ""  # PEM CA: when set, TCP clients must present a certificate it signed
    insecure_tcp: bool = False  # UNSAFE: TCP without TLS, for loopback tests only
    tokens_file: str = ""  # bearer tokens, lines "tenant token" ('#' comments); "" = tenant from the unix peer
    metrics_host: str = "127.0.0.1"  # address of the Prometheus endpoint
    metrics_port: int = 9464  # TCP port; 0 = a free port; -1 = no metrics endpoint
    lease_s: float = 30.0  # seconds: a session is reclaimed this long after its last call unless a KeepAlive is open
    grace_s: float = 10.0  # seconds: on SIGTERM, in-flight calls get this long
    max_message_bytes: int = 16 * MiB  # bytes: largest gRPC message either way
    health_tcp: str = ""  # "host:port": plaintext, grpc.health.v1 only (Kubernetes gRPC probes); "" = none
    admin_tenants: str = ""  # comma-separated tenants allowed fleet-wide Evict/Flush/Drain; "" = the daemon's own uid
    socket_group: str = ""  # group name or gid given the unix socket and its fd socket; "" = the daemon's group
    socket_mode: str = "0600"  # octal mode of the unix socket and its fd socket; "0660" lets socket_group connect

    def __post_init__(self) -> None:
        tls = bool(self.tls_cert)
        require(tls == bool(self.tls_key), "server.tls_cert and server.tls_key go together: set both or neither")
        require(self.socket or self.tcp, "nothing to listen on: set server.socket or server.tcp")
        require(not self.tcp or _is_host_port(self.tcp),
                f"server.tcp must be HOST:PORT (port 0 to 65535), got {self.tcp!r}")
        require(not self.health_tcp or _is_host_port(self.health_tcp),
                f"server.health_tcp must be HOST:PORT (port 0 to 65535), got {self.health_tcp!r}")
        require(not self.tcp or tls or self.insecure_tcp, "server.tcp needs TLS (server.tls_cert and server.tls_key), "
                "or server.insecure_tcp = true for loopback tests (unsafe: traffic in the clear, anyone may connect)")
        require(not self.tls_client_ca or tls,
                "server.tls_client_ca requires TLS: set server.tls_cert and server.tls_key")
        require(-1 <= self.metrics_port <= 65535,
                f"server.metrics_port must be -1 (off) to 65535, got {self.metrics_port}")
        require(self.lease_s > 0, f"server.lease_s must be > 0, got {self.lease_s}")
        require(self.grace_s >= 0, f"server.grace_s must be >= 0, got {self.grace_s}")
        require(self.max_message_bytes > 0, "server.max_message_bytes must be > 0")
        require(re.fullmatch(r"0?[0-7]{3}", self.socket_mode) and int(self.socket_mode, 8) & 0o600 == 0o600,
                f"server.socket_mode must be an octal mode that keeps the owner's rw, like 0600 or 0660; "
                f"got {self.socket_mode!r}")


def _is_host_port(address: str) -> bool:
    host, _, port = address.rpartition(":")
    return bool(host) and port.isdigit() and int(port) <= 65535


def admin_tenant_names(server: ServerConfig) -> frozenset[str]:
    """Tenants allowed fleet-wide Evict / Flush / Drain: server.admin_tenants, else the uid the
    daemon runs as (who owns the 0600 socket)."""
    names = {name.strip() for name in server.admin_tenants.split(",") if name.strip()}
    return frozenset(names or {f"uid:{os.getuid()}"})
