"""Configuration of `kvtierd serve`: defaults, then a TOML file, then KVTIERD_* environment
variables, then command-line flags; a later source overrides an earlier one key by key.

A laptop needs no file: a unix socket under $XDG_RUNTIME_DIR (or /tmp/kvtierd-<uid>), a 256 MiB
device pool per layout, and per node 1 GiB of host memory and 4 GiB of SSD under the user's cache
directory (bounded, when not set, by the slot files there plus half the free space).

One key, three spellings: `[ssd] capacity_bytes = "8GiB"` in the file, KVTIERD_SSD_CAPACITY_BYTES
in the environment, `--set ssd.capacity_bytes=8GiB` on the command line (the top-level `log_level`
is KVTIERD_LOG_LEVEL). Per-tenant quotas are file tables `[quotas."tenant-a"]`, or
`--set quotas.tenant-a.t0_bytes=1GiB`. Unknown sections, keys and KVTIERD_ variables are errors:
a typo must not pass silently. A key ending in `_bytes` is a size (`units.parse_bytes`: "40GB" is
40·10⁹ bytes, "40GiB" 40·2³⁰).

No torch here; the default socket path is kvtierd/endpoints.py's, shared with the client.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import os
import re
import tomllib
from collections.abc import Iterable, Iterator, Mapping

from kvtierd.endpoints import default_socket_path
from kvtierd.errors import InvalidArgument
from kvtierd.node.remote_section import RemoteSection
from kvtierd.t2.ssd_space import default_capacity_bytes
from kvtierd.units import GiB, MiB, parse_bytes

CODECS = ("raw", "fp8")
EDGE_POLICIES = ("write_through", "on_evict", "off")
HASH_ALGOS = ("sha256", "xxh3_128")
DURABILITY_POLICIES = ("fdatasync", "none")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
EVENT_FORMATS = ("map", "array")  # vLLM KV events: tagged maps (vLLM #42892 on, 0.32 here), positional (older)
EVENT_SALTS = ("tenant", "none")
REMOTE_MODES = ("auto", "cluster", "single")
CHOICES = {"pool.hash_algo": HASH_ALGOS, "host.codec": CODECS, "ssd.codec": CODECS,  # key -> its allowed values
           "ssd.durability": DURABILITY_POLICIES, "policy.t0_to_t1": EDGE_POLICIES,
           "policy.t1_to_t2": EDGE_POLICIES, "policy.t1_to_t3": EDGE_POLICIES,
           "policy.t2_to_t3": ("write_through", "off"), "remote.mode": REMOTE_MODES, "remote.codec": CODECS,
           "events.format": EVENT_FORMATS, "events.salt": EVENT_SALTS,
           "log_level": LOG_LEVELS}
DEFAULT_SSD_CAPACITY_BYTES = 4 * GiB  # when not set: bounded by the slot files there plus half the free space
CONFIG_ENV = "KVTIERD_CONFIG"  # names the config file when load_config gets no path
FOREIGN_ENV_PREFIXES = ("KVTIERD_BENCH_", "KVTIERD_TOKEN",
                        "KVTIERD_ADDRESS")  # of the client and benchmarks; serve ignores them


def default_ssd_dir(environ: Mapping[str, str] = os.environ) -> str:
    """$XDG_CACHE_HOME/kvtierd where that variable is an absolute path, else ~/.cache/kvtierd."""
    cache_home = environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(cache_home):
        cache_home = os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache_home, "kvtierd")


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


@dataclasses.dataclass(frozen=True, slots=True)
class PoolConfig:
    device: str = "auto"  # "auto" | "cpu" | "cuda" | "cuda:N"
    t0_bytes: int = 256 * MiB  # bytes: device pool (T0), per layout
    max_layouts: int = 4  # count: distinct layouts (pools) served at once
    hash_algo: str = "sha256"  # "sha256" | "xxh3_128"


@dataclasses.dataclass(frozen=True, slots=True)
class HostConfig:
    capacity_bytes: int = 1 * GiB  # bytes: host-memory tier (T1) of the node, split evenly over pool.max_layouts
    codec: str = "raw"  # "raw" | "fp8"


@dataclasses.dataclass(frozen=True, slots=True)
class SsdConfig:
    directory: str = dataclasses.field(default_factory=default_ssd_dir)  # SSD tier (T2) files; "" disables T2
    capacity_bytes: int = DEFAULT_SSD_CAPACITY_BYTES  # bytes: SSD tier (T2) of the node, all layouts' files
    codec: str = "raw"  # "raw" | "fp8"
    durability: str = "fdatasync"  # "fdatasync" | "none"
    o_direct: bool = True  # bypass the page cache where the filesystem allows


@dataclasses.dataclass(frozen=True, slots=True)
class PolicyConfig:
    t0_to_t1: str = "on_evict"  # "write_through" | "on_evict" | "off"
    t1_to_t2: str = "write_through"  # "write_through" | "on_evict" | "off"
    recompute_s_per_token: float = 0.0  # seconds per token; 0 = always load lower-tier hits
    t1_to_t3: str = "write_through"  # into T3 (with remote.endpoints): "write_through" | "on_evict" | "off"
    t2_to_t3: str = "off"  # "write_through" | "off"


@dataclasses.dataclass(frozen=True, slots=True)
class EventsConfig:
    """The KV event feed in vLLM's wire format (server/zmq_publisher.py). It reveals every tenant's
    prefixes: off by default, and only on this machine unless allow_remote."""

    zmq_endpoint: str = ""  # ZMQ PUB: "tcp://127.0.0.1:5557", "ipc:///run/kvtierd/events"; "" = off
    replay_endpoint: str = ""  # ZMQ ROUTER answering "batches from seq N" (vLLM's replay); "" = none
    connect: bool = False  # connect the PUB socket to zmq_endpoint (a subscriber that binds) instead of binding
    topic: str = "kvtierd"  # first frame of every message; "{model}" is replaced by the pool's model id
    buffer_steps: int = 10_000  # batches kept for replay
    max_queued_events: int = 100_000  # events waiting for the publisher thread; beyond it they are dropped, counted
    format: str = "map"  # "map" | "array"
    int_block_hashes: bool = True  # hashes as u64 ints, as vLLM by default (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1)
    salt: str = "tenant"  # "tenant": a chain's first block carries its tenant's name in extra_keys | "none"
    lower_tiers: bool = True  # also publish T1 (medium CPU) and T2 (medium STORAGE), not only T0 (GPU)
    allow_remote: bool = False  # allow a non-loopback endpoint (prefixes leave the machine)


@dataclasses.dataclass(frozen=True, slots=True)
class Quota:
    t0_bytes: int = 0  # bytes of T0 one tenant may hold; 0 = unlimited
    t1_bytes: int = 0  # bytes of T1; 0 = unlimited
    t2_bytes: int = 0  # bytes of T2; 0 = unlimited


@dataclasses.dataclass(frozen=True, slots=True)
class DaemonConfig:
    server: ServerConfig = dataclasses.field(default_factory=ServerConfig)
    pool: PoolConfig = dataclasses.field(default_factory=PoolConfig)
    host: HostConfig = dataclasses.field(default_factory=HostConfig)
    ssd: SsdConfig = dataclasses.field(default_factory=SsdConfig)
    policy: PolicyConfig = dataclasses.field(default_factory=PolicyConfig)
    events: EventsConfig = dataclasses.field(default_factory=EventsConfig)
    remote: RemoteSection = dataclasses.field(default_factory=RemoteSection)
    quotas: dict[str, Quota] = dataclasses.field(default_factory=dict)  # tenant -> quota
    log_level: str = "info"  # "debug" | "info" | "warning" | "error" | "critical"


SECTIONS = {"server": ServerConfig, "pool": PoolConfig, "host": HostConfig, "ssd": SsdConfig, "policy": PolicyConfig,
            "events": EventsConfig, "remote": RemoteSection}
# Dotted key -> type of its value (str, int, float or bool), for every key but the quotas.
KEY_TYPES = {f"{section}.{field.name}": type(getattr(cls(), field.name))
             for section, cls in SECTIONS.items() for field in dataclasses.fields(cls)} | {"log_level": str}
QUOTA_KEYS = tuple(field.name for field in dataclasses.fields(Quota))
ENV_KEYS = {"KVTIERD_" + key.replace(".", "_").upper(): key for key in KEY_TYPES}
_BOOLS = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}


def load_config(path: str | None = None, environ: Mapping[str, str] = os.environ,
                overrides: Mapping[str, object] = {}) -> DaemonConfig:
    """Defaults < the TOML file (`path`, else $KVTIERD_CONFIG) < KVTIERD_* variables < `overrides`
    (dotted keys, as `overrides_from_args` makes them; None values are ignored); then validated."""
    settings: dict[str, object] = {"server.socket": default_socket_path(environ),
                                   "ssd.directory": default_ssd_dir(environ)}
    path = path if path is not None else environ.get(CONFIG_ENV) or None
    if path is not None:
        for key, value in _file_items(path):
            _apply(settings, key, value, f"config file {path}")
    for name in sorted(environ):
        if name.startswith("KVTIERD_") and name != CONFIG_ENV and not name.startswith(FOREIGN_ENV_PREFIXES):
            if name not in ENV_KEYS:
                raise InvalidArgument(f"unknown environment variable {name}{_suggest(name, ENV_KEYS)}; "
                                      f"kvtierd serve reads {CONFIG_ENV} and KVTIERD_<SECTION>_<KEY>")
            _apply(settings, ENV_KEYS[name], environ[name], name)
    for key, value in overrides.items():
        if value is not None:
            _apply(settings, key, value, "the command line")
    if "ssd.capacity_bytes" not in settings and settings.get("ssd.directory"):  # the default: bounded by the disk
        settings["ssd.capacity_bytes"] = default_capacity_bytes(str(settings["ssd.directory"]),
                                                                DEFAULT_SSD_CAPACITY_BYTES)
    config = _build(settings)
    _validate(config)
    return config


def _file_items(path: str) -> Iterator[tuple[str, object]]:
    try:
        with open(path, "rb") as file:
            return _flatten(tomllib.load(file))
    except FileNotFoundError:
        raise InvalidArgument(f"config file {path} not found") from None
    except tomllib.TOMLDecodeError as e:  # its message names the line and column
        raise InvalidArgument(f"config file {path}: invalid TOML: {e}") from None
    except OSError as e:
        raise InvalidArgument(f"config file {path}: {e.strerror}") from None


def _flatten(table: Mapping[str, object], prefix: str = "") -> Iterator[tuple[str, object]]:
    """Nested tables as dotted keys: [quotas."tenant-a"] t0_bytes -> quotas.tenant-a.t0_bytes."""
    for name, value in table.items():
        if isinstance(value, dict):
            yield from _flatten(value, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}", value


def _apply(settings: dict[str, object], key: str, value: object, source: str) -> None:
    parts = key.split(".")
    if parts[0] == "quotas" and len(parts) >= 3 and parts[-1] in QUOTA_KEYS:
        value_type: type = int
    elif key in KEY_TYPES:
        value_type = KEY_TYPES[key]
    else:
        known = [f"quotas.<tenant>.{name}" for name in QUOTA_KEYS] if parts[0] == "quotas" else KEY_TYPES
        raise InvalidArgument(f"unknown config key {key!r} in {source}{_suggest(key, known)}")
    settings[key] = _convert(key, value_type, value, source)


def _convert(key: str, value_type: type, value: object, source: str) -> object:
    """`value` (a string from the environment or a flag, or a TOML value) as the key's type."""
    try:
        if key.endswith("_bytes"):
            return parse_bytes(value)  # type: ignore[arg-type]
        if isinstance(value, str) and value_type is not str:
            return _BOOLS[value.strip().lower()] if value_type is bool else value_type(value.strip())
        if type(value) is value_type or (value_type is float and type(value) is int):
            return value_type(value)
    except InvalidArgument as e:
        raise InvalidArgument(f"{key} (from {source}): {e}") from None
    except (KeyError, ValueError):
        pass
    expected = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}[value_type]
    raise InvalidArgument(f"{key} (from {source}) must be {expected}, got {value!r}")


def _suggest(name: str, known: Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(known), n=1)
    return f" (did you mean {close[0]}?)" if close else ""


def _build(settings: Mapping[str, object]) -> DaemonConfig:
    sections: dict[str, dict[str, object]] = {name: {} for name in SECTIONS}
    quotas: dict[str, dict[str, object]] = {}
    for key, value in settings.items():
        parts = key.split(".")
        if parts[0] == "quotas":
            quotas.setdefault(".".join(parts[1:-1]), {})[parts[-1]] = value
        elif len(parts) == 2:
            sections[parts[0]][parts[1]] = value
    return DaemonConfig(**{name: SECTIONS[name](**values) for name, values in sections.items()},
                        quotas={tenant: Quota(**values) for tenant, values in quotas.items()},
                        log_level=str(settings.get("log_level", "info")))


def _validate(config: DaemonConfig) -> None:
    server, pool = config.server, config.pool
    tls = bool(server.tls_cert)
    rules = (
        (bool(server.tls_cert) == bool(server.tls_key),
         "server.tls_cert and server.tls_key go together: set both or neither"),
        (server.socket or server.tcp, "nothing to listen on: set server.socket or server.tcp"),
        (not server.tcp or _is_host_port(server.tcp),
         f"server.tcp must be HOST:PORT (port 0 to 65535), got {server.tcp!r}"),
        (not server.health_tcp or _is_host_port(server.health_tcp),
         f"server.health_tcp must be HOST:PORT (port 0 to 65535), got {server.health_tcp!r}"),
        (not server.tcp or tls or server.insecure_tcp, "server.tcp needs TLS (server.tls_cert and server.tls_key), "
         "or server.insecure_tcp = true for loopback tests (unsafe: traffic in the clear, anyone may connect)"),
        (not server.tls_client_ca or tls, "server.tls_client_ca requires TLS: set server.tls_cert and server.tls_key"),
        (-1 <= server.metrics_port <= 65535,
         f"server.metrics_port must be -1 (off) to 65535, got {server.metrics_port}"),
        (server.lease_s > 0, f"server.lease_s must be > 0, got {server.lease_s}"),
        (server.grace_s >= 0, f"server.grace_s must be >= 0, got {server.grace_s}"),
        (server.max_message_bytes > 0, "server.max_message_bytes must be > 0"),
        (re.fullmatch(r"0?[0-7]{3}", server.socket_mode) and int(server.socket_mode, 8) & 0o600 == 0o600,
         f"server.socket_mode must be an octal mode that keeps the owner's rw, like 0600 or 0660; "
         f"got {server.socket_mode!r}"),
        (pool.t0_bytes > 0, "pool.t0_bytes must be > 0"),
        (pool.max_layouts >= 1, f"pool.max_layouts must be >= 1, got {pool.max_layouts}"),
        (re.fullmatch(r"auto|cpu|cuda(:\d+)?", pool.device),
         f"pool.device must be auto, cpu, cuda or cuda:N; got {pool.device!r}"),
        (config.policy.recompute_s_per_token >= 0, "policy.recompute_s_per_token must be >= 0 (0: always load)"),
        (not (config.remote.password and config.remote.password_file),
         "remote.password and remote.password_file: set one of them"),
    )
    for ok, message in rules + _events_rules(config.events):
        if not ok:
            raise InvalidArgument(message)
    for key, allowed in CHOICES.items():
        value = functools.reduce(getattr, key.split("."), config)
        if value not in allowed:
            raise InvalidArgument(f"{key} must be one of {', '.join(allowed)}; got {value!r}")


def _events_rules(events: EventsConfig) -> tuple:
    endpoints = [("events.zmq_endpoint", events.zmq_endpoint), ("events.replay_endpoint", events.replay_endpoint)]
    rules = [(not events.replay_endpoint or events.zmq_endpoint, "events.replay_endpoint needs events.zmq_endpoint"),
             (events.buffer_steps >= 1, f"events.buffer_steps must be >= 1, got {events.buffer_steps}"),
             (events.max_queued_events >= 1, f"events.max_queued_events must be >= 1, got {events.max_queued_events}")]
    for key, endpoint in endpoints:
        if endpoint:
            rules.append((re.fullmatch(r"(tcp://\S+:(\d+|\*)|ipc://\S+|inproc://\S+)", endpoint),
                          f"{key} must be tcp://HOST:PORT, ipc://PATH or inproc://NAME; got {endpoint!r}"))
            rules.append((events.allow_remote or is_local_endpoint(endpoint),
                          f"{key} {endpoint!r} is not a loopback address: KV events reveal every tenant's prefixes; "
                          "bind 127.0.0.1 or ipc://, or set events.allow_remote = true"))
    return tuple(rules)


def is_local_endpoint(endpoint: str) -> bool:
    """A ZMQ endpoint only this machine reaches: ipc://, inproc://, or tcp on a loopback address."""
    if endpoint.startswith(("ipc://", "inproc://")):
        return True
    host = endpoint.removeprefix("tcp://").rpartition(":")[0].strip("[]")
    return host == "localhost" or host == "::1" or re.fullmatch(r"127(\.\d{1,3}){3}", host) is not None


def _is_host_port(address: str) -> bool:
    host, _, port = address.rpartition(":")
    return bool(host) and port.isdigit() and int(port) <= 65535


def admin_tenant_names(server: ServerConfig) -> frozenset[str]:
    """Tenants allowed fleet-wide Evict / Flush / Drain: server.admin_tenants, else the uid the
    daemon runs as (who owns the 0600 socket)."""
    names = {name.strip() for name in server.admin_tenants.split(",") if name.strip()}
    return frozenset(names or {f"uid:{os.getuid()}"})


# flag, config key, metavar, help; each help names its environment variable.
_FLAGS = (
    ("--socket", "server.socket", "PATH", "unix socket path ('' for none)"),
    ("--tcp", "server.tcp", "HOST:PORT", "also listen on TCP (needs TLS, or --insecure-tcp)"),
    ("--tls-cert", "server.tls_cert", "PEM", "TLS certificate chain for TCP"),
    ("--tls-key", "server.tls_key", "PEM", "TLS private key for TCP"),
    ("--tls-client-ca", "server.tls_client_ca", "PEM", "CA that must have signed TCP client certificates"),
    ("--tokens-file", "server.tokens_file", "PATH", "bearer tokens, lines 'tenant token' (default: unix peer)"),
    ("--metrics-host", "server.metrics_host", "HOST", "address of the Prometheus endpoint"),
    ("--metrics-port", "server.metrics_port", "PORT", "Prometheus port (0: a free port, -1: none)"),
    ("--health-tcp", "server.health_tcp", "HOST:PORT", "plaintext grpc.health.v1 only, for Kubernetes probes"),
    ("--lease-s", "server.lease_s", "SECONDS", "a session is reclaimed this long after its last call"),
    ("--device", "pool.device", "DEVICE", "auto, cpu, cuda or cuda:N"),
    ("--t0-bytes", "pool.t0_bytes", "SIZE", "device pool (T0) per layout, e.g. 256MiB"),
    ("--host-bytes", "host.capacity_bytes", "SIZE", "host-memory tier (T1) of the node, e.g. 1GiB"),
    ("--ssd-dir", "ssd.directory", "DIR", "SSD tier (T2) directory ('' disables T2)"),
    ("--ssd-bytes", "ssd.capacity_bytes", "SIZE", "SSD tier (T2) of the node, e.g. 4GiB"),
    ("--log-level", "log_level", "LEVEL", ", ".join(LOG_LEVELS)),
)
_ENV_OF = {key: name for name, key in ENV_KEYS.items()}
_FLAG_OF = {key: flag for flag, key, _, _ in _FLAGS} | {"server.insecure_tcp": "--insecure-tcp"}


def setting_name(key: str) -> str:
    """How an error names a config key: "--ssd-dir (ssd.directory)" where a flag sets it, else the key."""
    flag = _FLAG_OF.get(key)
    return f"{flag} ({key})" if flag else key


def _dest(key: str) -> str:
    return "config_" + key.replace(".", "_")


def add_flags(parser: argparse.ArgumentParser) -> None:
    """The configuration flags of `kvtierd serve`; `args.config` is the file, for load_config."""
    group = parser.add_argument_group("configuration", "flags override KVTIERD_* variables, which "
                                      "override the config file, which overrides the defaults")
    group.add_argument("--config", metavar="PATH", help=f"TOML config file [env {CONFIG_ENV}]")
    for flag, key, metavar, text in _FLAGS:
        group.add_argument(flag, dest=_dest(key), metavar=metavar, help=f"{text} [env {_ENV_OF[key]}]")
    group.add_argument("--insecure-tcp", dest=_dest("server.insecure_tcp"), action="store_true", default=None,
                       help="UNSAFE: allow TCP without TLS, for loopback tests only "
                            f"[env {_ENV_OF['server.insecure_tcp']}]")
    group.add_argument("--set", dest=_dest("set"), action="append", default=[], metavar="SECTION.KEY=VALUE",
                       help="any config key, repeatable, applied after the flags above [env KVTIERD_SECTION_KEY]")


def overrides_from_args(args: argparse.Namespace) -> dict[str, object]:
    """The flags `add_flags` defined, as load_config's overrides (flags not given are left out)."""
    keys = [key for _, key, _, _ in _FLAGS] + ["server.insecure_tcp"]
    overrides = {key: getattr(args, _dest(key)) for key in keys if getattr(args, _dest(key), None) is not None}
    for item in getattr(args, _dest("set"), None) or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise InvalidArgument(f"--set expects SECTION.KEY=VALUE, got {item!r}")
        overrides[key.strip()] = value
    return overrides
