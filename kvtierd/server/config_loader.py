"""Where `kvtierd serve`'s configuration comes from: defaults, then a TOML file, then KVTIERD_*
environment variables, then command-line flags; a later source overrides an earlier one key by key.

A laptop needs no file: a unix socket under $XDG_RUNTIME_DIR (or /tmp/kvtierd-<uid>), a 256 MiB
device pool per layout, and per node 1 GiB of host memory and 4 GiB of SSD under the user's cache
directory (bounded, when not set, by the slot files there plus half the free space; none below
64 MiB). `given_keys` records which keys a source set, so that a default can be told from a choice.

One key, three spellings: `[ssd] capacity_bytes = "8GiB"` in the file, KVTIERD_SSD_CAPACITY_BYTES
in the environment, `--set ssd.capacity_bytes=8GiB` on the command line (the top-level `log_level`
is KVTIERD_LOG_LEVEL). Per-tenant quotas are file tables `[quotas."tenant-a"]`, or
`--set quotas.tenant-a.t0_bytes=1GiB`. Unknown sections, keys and KVTIERD_ variables are errors:
a typo must not pass silently. A key ending in `_bytes` is a size (`units.parse_bytes`: "40GB" is
40·10⁹ bytes, "40GiB" 40·2³⁰).

This module only reads and converts text; each section checks its own values when it is built
(daemon_config.py names where each is defined). No torch here; the default socket path is
kvtierd/endpoints.py's, shared with the client.
"""

from __future__ import annotations

import difflib
import os
import tomllib
from collections.abc import Iterable, Iterator, Mapping
from typing import cast

from kvtierd.endpoints import default_socket_path
from kvtierd.errors import InvalidArgument
from kvtierd.server.daemon_config import KEY_TYPES, QUOTA_KEYS, SECTIONS, DaemonConfig, Quota
from kvtierd.t2.ssd_config import DEFAULT_SSD_CAPACITY_BYTES, default_ssd_dir
from kvtierd.t2.ssd_space import default_capacity_bytes
from kvtierd.units import parse_bytes

CONFIG_ENV = "KVTIERD_CONFIG"  # names the config file when load_config gets no path
FOREIGN_ENV_PREFIXES = ("KVTIERD_BENCH_", "KVTIERD_TOKEN",
                        "KVTIERD_ADDRESS")  # of the client and benchmarks; serve ignores them
ENV_KEYS = {"KVTIERD_" + key.replace(".", "_").upper(): key for key in KEY_TYPES}
_BOOLS = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}


def load_config(path: str | None = None, environ: Mapping[str, str] = os.environ,
                overrides: Mapping[str, object] = {}) -> DaemonConfig:
    """Defaults < the TOML file (`path`, else $KVTIERD_CONFIG) < KVTIERD_* variables < `overrides`
    (dotted keys, as `config_flags.overrides_from_args` makes them; None values are ignored); each
    section validates itself as it is built."""
    settings: dict[str, object] = {"server.socket": default_socket_path(environ),
                                   "ssd.directory": default_ssd_dir(environ)}
    given: set[str] = set()  # the keys a source set; the others keep their defaults
    path = path if path is not None else environ.get(CONFIG_ENV) or None
    if path is not None:
        for key, value in _file_items(path):
            given.add(_apply(settings, key, value, f"config file {path}"))
    for name in sorted(environ):
        if name.startswith("KVTIERD_") and name != CONFIG_ENV and not name.startswith(FOREIGN_ENV_PREFIXES):
            if name not in ENV_KEYS:
                raise InvalidArgument(f"unknown environment variable {name}{_suggest(name, ENV_KEYS)}; "
                                      f"kvtierd serve reads {CONFIG_ENV} and KVTIERD_<SECTION>_<KEY>")
            given.add(_apply(settings, ENV_KEYS[name], environ[name], name))
    for key, value in overrides.items():
        if value is not None:
            given.add(_apply(settings, key, value, "the command line"))
    if "ssd.capacity_bytes" not in settings and settings.get("ssd.directory"):  # the default: bounded by the disk
        settings["ssd.capacity_bytes"] = default_capacity_bytes(str(settings["ssd.directory"]),
                                                                DEFAULT_SSD_CAPACITY_BYTES)
    return _build(settings, frozenset(given))


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


def _apply(settings: dict[str, object], key: str, value: object, source: str) -> str:
    """Set `key` to `value` converted to its type; returns the key."""
    parts = key.split(".")
    if parts[0] == "quotas" and len(parts) >= 3 and parts[-1] in QUOTA_KEYS:
        value_type: type = int
    elif key in KEY_TYPES:
        value_type = KEY_TYPES[key]
    else:
        known = [f"quotas.<tenant>.{name}" for name in QUOTA_KEYS] if parts[0] == "quotas" else KEY_TYPES
        raise InvalidArgument(f"unknown config key {key!r} in {source}{_suggest(key, known)}")
    settings[key] = _convert(key, value_type, value, source)
    return key


def _convert(key: str, value_type: type, value: object, source: str) -> object:
    """`value` (a string from the environment or a flag, or a TOML value) as the key's type."""
    try:
        if key.endswith("_bytes"):
            return parse_bytes(value)
        if isinstance(value, str) and value_type is not str:
            return _BOOLS[value.strip().lower()] if value_type is bool else value_type(value.strip())
        if type(value) is value_type:
            return value
        if value_type is float and type(value) is int:
            return float(value)
    except InvalidArgument as e:
        raise InvalidArgument(f"{key} (from {source}): {e}") from None
    except (KeyError, ValueError):
        pass
    expected = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}[value_type]
    raise InvalidArgument(f"{key} (from {source}) must be {expected}, got {value!r}")


def _suggest(name: str, known: Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(known), n=1)
    return f" (did you mean {close[0]}?)" if close else ""


def _build(settings: Mapping[str, object], given_keys: frozenset[str]) -> DaemonConfig:
    sections: dict[str, dict[str, object]] = {name: {} for name in SECTIONS}
    quotas: dict[str, dict[str, int]] = {}
    for key, value in settings.items():
        parts = key.split(".")
        if parts[0] == "quotas":
            quotas.setdefault(".".join(parts[1:-1]), {})[parts[-1]] = cast(int, value)  # _apply made it an int
        elif len(parts) == 2:
            sections[parts[0]][parts[1]] = value
    return DaemonConfig(**{name: SECTIONS[name](**values) for name, values in sections.items()},
                        quotas={tenant: Quota(**values) for tenant, values in quotas.items()},
                        log_level=str(settings.get("log_level", "info")), given_keys=given_keys)
