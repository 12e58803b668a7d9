"""The configuration of `kvtierd serve`: one section per table of its TOML file, each the type of
the part it configures and defined beside it, each checking its own values when built.

| section    | type           | where                           |
|------------|----------------|---------------------------------|
| [server]   | ServerConfig   | kvtierd/server/server_config.py |
| [pool]     | PoolConfig     | kvtierd/node/pool_config.py     |
| [host]     | HostConfig     | kvtierd/t1/host_config.py       |
| [ssd]      | SsdConfig      | kvtierd/t2/ssd_config.py        |
| [policy]   | PolicyConfig   | kvtierd/tiering/tier_config.py  |
| [events]   | EventsConfig   | kvtierd/events/events_config.py |
| [remote]   | RemoteConfig   | kvtierd/t3/remote_config.py     |
| [retention]| RetentionConfig| kvtierd/retention/retention_config.py |
| [encryption]| EncryptionConfig| kvtierd/sealing/encryption_config.py |
| [quotas.*] | Quota          | kvtierd/node/quotas.py          |

Where the values come from (defaults, the file, KVTIERD_* variables, flags) is config_loader.py;
the flags of `kvtierd serve` are config_flags.py. No torch here.
"""

from __future__ import annotations

import dataclasses

from kvtierd.config_checks import require_choice
from kvtierd.events.events_config import EventsConfig
from kvtierd.node.pool_config import PoolConfig
from kvtierd.node.quotas import Quota
from kvtierd.retention.retention_config import RetentionConfig
from kvtierd.sealing.encryption_config import EncryptionConfig
from kvtierd.server.server_config import ServerConfig
from kvtierd.t1.host_config import HostConfig
from kvtierd.t2.ssd_config import SsdConfig
from kvtierd.t3.remote_config import RemoteConfig
from kvtierd.tiering.tier_config import PolicyConfig

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


@dataclasses.dataclass(frozen=True, slots=True)
class DaemonConfig:
    server: ServerConfig = dataclasses.field(default_factory=ServerConfig)
    pool: PoolConfig = dataclasses.field(default_factory=PoolConfig)
    host: HostConfig = dataclasses.field(default_factory=HostConfig)
    ssd: SsdConfig = dataclasses.field(default_factory=SsdConfig)
    policy: PolicyConfig = dataclasses.field(default_factory=PolicyConfig)
    events: EventsConfig = dataclasses.field(default_factory=EventsConfig)
    remote: RemoteConfig = dataclasses.field(default_factory=RemoteConfig)
    retention: RetentionConfig = dataclasses.field(default_factory=RetentionConfig)
    encryption: EncryptionConfig = dataclasses.field(default_factory=EncryptionConfig)
    quotas: dict[str, Quota] = dataclasses.field(default_factory=dict)  # tenant -> quota
    log_level: str = "info"  # "debug" | "info" | "warning" | "error" | "critical"
    # The dotted keys a source set (file, KVTIERD_* variable, flag); the others hold defaults. Not a
    # key itself: load_config fills it, so that a default can be told from a choice (ssd_state.py).
    given_keys: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        require_choice("log_level", self.log_level, LOG_LEVELS)


SECTIONS = {"server": ServerConfig, "pool": PoolConfig, "host": HostConfig, "ssd": SsdConfig, "policy": PolicyConfig,
            "events": EventsConfig, "remote": RemoteConfig, "retention": RetentionConfig,
            "encryption": EncryptionConfig}


def _file_type(field: dataclasses.Field) -> type:
    """The type a key's value has in the file: its default's, but a tuple is written as one
    comma-separated string (remote.endpoints) that its section parses."""
    default = field.default
    if default is dataclasses.MISSING:
        assert field.default_factory is not dataclasses.MISSING, f"config key {field.name} has no default"
        default = field.default_factory()
    return str if isinstance(default, tuple) else type(default)


# Dotted key -> type of its value in the file (str, int, float or bool), for every key but the quotas.
KEY_TYPES = {f"{section}.{field.name}": _file_type(field)
             for section, cls in SECTIONS.items() for field in dataclasses.fields(cls)} | {"log_level": str}
QUOTA_KEYS = tuple(field.name for field in dataclasses.fields(Quota))
