"""The configuration flags of `kvtierd serve`: one flag for the keys set most often, `--set` for any
key, each flag's help naming its KVTIERD_* variable; and how an error names a key (its flag too).
No torch here."""

from __future__ import annotations

import argparse

from kvtierd.errors import InvalidArgument
from kvtierd.server.config_loader import CONFIG_ENV, ENV_KEYS
from kvtierd.server.daemon_config import LOG_LEVELS

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
