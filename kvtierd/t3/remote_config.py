"""How a daemon reaches the shared store (T3): the daemon file's [remote] section, and what
RedisStore is built with: endpoints, credentials, timeouts, limits. No torch here.

The file spells the endpoints "host:port,host:port"; a RemoteConfig holds them parsed, and none
means no T3. The password comes from `password_file` (a mounted Kubernetes Secret key; a trailing
newline is dropped, `with_password_read`) or `password`; `repr` never shows it, and nothing logs a
RemoteConfig's credentials.
"""

from __future__ import annotations

import dataclasses

from kvtierd.config_checks import require, require_choice
from kvtierd.errors import InvalidArgument
from kvtierd.movers.codec_names import CODEC_NAMES
from kvtierd.units import MiB

MODES = ("auto", "cluster", "single")


@dataclasses.dataclass(frozen=True)
class RemoteConfig:
    """[remote]: T3, a shared tier on an existing Redis Cluster, single Redis or Valkey.

    `endpoints` may be given as the file's text; it is held as ((host, port), ...).
    """

    endpoints: tuple[tuple[str, int], ...] = ()  # seeds: (host, port); the file's "host:port,host:port"; () = no T3
    mode: str = "auto"  # "auto": the first seed's CLUSTER INFO decides; "cluster"; "single"
    username: str = ""  # Redis ACL user; "" = the default user
    password: str = dataclasses.field(default="", repr=False)  # prefer password_file; never logged
    password_file: str = ""  # file holding the password: a mounted Kubernetes Secret key
    tls: bool = False  # TLS to the store
    tls_ca_file: str = ""  # PEM CA of the store's certificate; "" = the system's CAs
    tls_cert_file: str = ""  # PEM client certificate (mutual TLS), with tls_key_file
    tls_key_file: str = ""
    key_prefix: str = "kvtierd"  # first part of every key
    codec: str = "raw"  # "raw" | "fp8": what T3 values hold
    timeout_s: float = 0.5  # seconds per store operation
    max_write_backlog_bytes: int = 256 * MiB  # bytes queued for the store; beyond it writes are dropped, counted
    breaker_failures: int = 3  # failed calls in a row that open a node's breaker
    breaker_open_s: float = 5.0  # seconds a breaker stays open before one probe
    probe_interval_s: float = 2.0  # seconds between the daemon's PINGs of every store node (health)
    # seconds a value lives in the store (its own expiry); 0 = until the store evicts it. retention.max_age_s,
    # when smaller, bounds it too (value_ttl_ms)
    ttl_s: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.endpoints, str):
            seeds = parse_endpoints(self.endpoints)
            require(seeds or not self.endpoints, "remote.endpoints must name at least one host:port")
            object.__setattr__(self, "endpoints", seeds)
        require_choice("remote.mode", self.mode, MODES)
        require_choice("remote.codec", self.codec, CODEC_NAMES)
        require(not (self.password and self.password_file), "remote.password and remote.password_file: set one of them")
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

    @property
    def enabled(self) -> bool:
        """T3 is on: at least one seed."""
        return bool(self.endpoints)

    def value_ttl_ms(self, max_age_s: float = 0.0) -> int:
        """The expiry a value is written with, in milliseconds: the smaller of `ttl_s` and `max_age_s`
        (retention.max_age_s) where set, at least 1 ms; 0 = none."""
        limits_s = [limit_s for limit_s in (self.ttl_s, max_age_s) if limit_s > 0]
        return max(1, round(1000 * min(limits_s))) if limits_s else 0

    def with_password_read(self) -> RemoteConfig:
        """This config with `password` read from `password_file` (its line end dropped), for the
        store; a file that cannot be read is InvalidArgument naming the file only."""
        if not self.password_file:
            return self
        try:
            with open(self.password_file, encoding="utf-8") as f:
                password = f.read().rstrip("\r\n")
        except OSError as e:
            raise InvalidArgument(f"remote.password_file {self.password_file!r} cannot be read: {e.strerror}") from None
        except UnicodeDecodeError:
            raise InvalidArgument(f"remote.password_file {self.password_file!r} is not UTF-8 text") from None
        return dataclasses.replace(self, password=password, password_file="")


def parse_endpoints(text: str) -> tuple[tuple[str, int], ...]:
    """ "host:port,host:port" → ((host, port), ...); a bad entry is InvalidArgument."""
    endpoints = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        host, sep, port = item.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise InvalidArgument(f"remote.endpoints: {item!r} is not host:port")
        endpoints.append((host.strip("[]"), int(port)))
    return tuple(endpoints)


def format_endpoints(endpoints: tuple[tuple[str, int], ...]) -> str:
    """((host, port), ...) → "host:port,[v6]:port", as parse_endpoints reads it."""
    return ",".join(f"[{host}]:{port}" if ":" in host else f"{host}:{port}" for host, port in endpoints)
