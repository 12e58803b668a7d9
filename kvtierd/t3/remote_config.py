"""How a daemon reaches the shared store (T3): endpoints, credentials, timeouts, limits.

Built from the daemon config's [remote] section (node/daemon_config.py). The password is read
from `password_file` (a mounted Kubernetes Secret) when set; `repr` never shows it, and nothing
logs a RemoteConfig's credentials.
"""

from __future__ import annotations

import dataclasses

from kvtierd.errors import InvalidArgument

MODES = ("auto", "cluster", "single")


@dataclasses.dataclass(frozen=True)
class RemoteConfig:
    endpoints: tuple[tuple[str, int], ...]  # seeds: (host, port)
    mode: str = "auto"  # "auto": the first seed's CLUSTER INFO decides; "cluster"; "single"
    username: str = ""
    password: str = dataclasses.field(default="", repr=False)
    tls: bool = False
    tls_ca_file: str = ""
    tls_cert_file: str = ""
    tls_key_file: str = ""
    key_prefix: str = "kvtierd"
    codec: str = "raw"
    timeout_s: float = 0.5  # per store operation
    max_write_backlog_bytes: int = 256 << 20
    breaker_failures: int = 3
    breaker_open_s: float = 5.0
    probe_interval_s: float = 2.0  # the daemon PINGs every node this often: health with no traffic
    ttl_s: int = 0  # 0: until the store evicts the key

    def __post_init__(self) -> None:
        if not self.endpoints:
            raise InvalidArgument("remote.endpoints must name at least one host:port")
        if self.mode not in MODES:
            raise InvalidArgument(f"remote.mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if min(self.timeout_s, self.breaker_open_s, self.probe_interval_s) <= 0 or self.breaker_failures < 1:
            raise InvalidArgument("remote.timeout_s, remote.breaker_open_s and remote.probe_interval_s must be > 0, "
                                  "remote.breaker_failures >= 1")
        if self.ttl_s < 0 or self.max_write_backlog_bytes < 0:
            raise InvalidArgument("remote.ttl_s and remote.max_write_backlog_bytes must be >= 0")
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise InvalidArgument("remote.tls_cert_file and remote.tls_key_file go together")
        if not self.key_prefix or any(c in self.key_prefix for c in ":{}"):  # no hash tag: keys spread over slots
            raise InvalidArgument(f"remote.key_prefix must be non-empty, without ':', '{{' or '}}'; got "
                                  f"{self.key_prefix!r}")


def parse_endpoints(text: str) -> tuple[tuple[str, int], ...]:
    """ "host:port,host:port" → ((host, port), ...); a bad entry is InvalidArgument."""
    endpoints = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        host, sep, port = item.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise InvalidArgument(f"remote.endpoints: {item!r} is not host:port")
        endpoints.append((host.strip("[]"), int(port)))
    return tuple(endpoints)
