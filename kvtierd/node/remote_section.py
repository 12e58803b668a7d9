"""The daemon config's [remote] section, and the T3 store config it becomes.

The password comes from `password_file` (a mounted Kubernetes Secret key; a trailing newline is
dropped) or `password`; neither is shown by repr or written to a log. No torch here.
"""

from __future__ import annotations

import dataclasses

from kvtierd.errors import InvalidArgument
from kvtierd.units import MiB


@dataclasses.dataclass(frozen=True, slots=True)
class RemoteSection:
    """[remote]: T3, a shared tier on an existing Redis Cluster, single Redis or Valkey."""

    endpoints: str = ""  # comma-separated seeds "host:port,host:port"; "" = no T3
    mode: str = "auto"  # "auto" (the store says) | "cluster" | "single"
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
    ttl_s: int = 0  # seconds a value lives in the store; 0 = until the store evicts it


def remote_config_of(section: RemoteSection):
    """The T3 store's config (kvtierd.t3.remote_config.RemoteConfig), or None without endpoints.
    Reads the password file; a file that cannot be read is InvalidArgument (naming the file only)."""
    if not section.endpoints:
        return None
    from kvtierd.t3.remote_config import RemoteConfig, parse_endpoints

    password = section.password
    if section.password_file:
        try:
            with open(section.password_file, encoding="utf-8") as f:
                password = f.read().rstrip("\r\n")
        except OSError as e:
            raise InvalidArgument(f"remote.password_file {section.password_file!r} cannot be read: {e.strerror}")
        except UnicodeDecodeError:
            raise InvalidArgument(f"remote.password_file {section.password_file!r} is not UTF-8 text") from None
    fields = {f.name: getattr(section, f.name) for f in dataclasses.fields(section)
              if f.name not in ("endpoints", "password", "password_file")}
    return RemoteConfig(parse_endpoints(section.endpoints), password=password, **fields)


def remote_summary(section: RemoteSection, policy) -> list[str]:
    """Start-up lines about T3 (never the password)."""
    if not section.endpoints:
        return ["T3 shared store: off"]
    credential = ("password from " + section.password_file if section.password_file else
                  "password set" if section.password else "no password")
    lines = [f"T3 shared store: {section.endpoints} ({section.mode}, {'TLS' if section.tls else 'no TLS'}, "
             f"user {section.username or 'default'}, {credential}), codec {section.codec}, "
             f"keys {section.key_prefix}:*, timeout {section.timeout_s:g} s, "
             f"breaker {section.breaker_failures} failures / {section.breaker_open_s:g} s; "
             f"T1->T3 {policy.t1_to_t3}, T2->T3 {policy.t2_to_t3}"]
    if policy.t0_to_t1 != "write_through" and policy.t1_to_t3 != "off":
        lines.append(f"note: T0->T1 is {policy.t0_to_t1}: a block reaches T3 only once T0 evicts it; set "
                     "policy.t0_to_t1 = write_through for other nodes to see it at once")
    return lines
