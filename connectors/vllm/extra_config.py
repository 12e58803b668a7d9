"""The connector's settings: the keys of `kv_connector_extra_config` in vLLM's --kv-transfer-config.

Every key is optional. `address` (else KVTIERD_ADDRESS, else the default socket), `token` (else
KVTIERD_TOKEN), `model_id` (the key namespace; default the model name vLLM was given),
`lookup_wait_s` (0.005), `lookup_ttl_s` (2), `lookup_timeout_s` (1, or `lookup_wait_s` if longer:
a lookup slower than that counts no hit, the request goes on), `async_loads` (true: hits with
blocks in T1 or T2 load in the background, scheduler.py), `wait_timeout_s` (30: promotion wait per
load), `timeout_s` (5: per RPC), `retry_after_s` (5: between attach attempts), `start_attach_s`
(10: how long the engine's start waits for each Attach; one that takes longer is retried in the
background), `prefetch` (true: a Lookup that finds blocks in T2 starts their promotion to T1, so
the load that follows waits less; off, a Lookup has no side effect).

Values are taken as vLLM hands them over (JSON): numbers through float(), switches through
bool(). Keys the connector does not know are ignored, as vLLM passes the dict on as given.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from kvtierd.connectors.vllm.worker import DEFAULT_START_ATTACH_S


@dataclasses.dataclass(frozen=True, slots=True)
class VllmExtraConfig:
    address: str | None = None  # the daemon; None or "" = KVTIERD_ADDRESS, else the default socket
    token: str | None = None  # bearer token; None = KVTIERD_TOKEN
    model_id: str | None = None  # the key namespace; None = the model name vLLM was given
    lookup_wait_s: float = 0.005  # seconds the scheduler waits for a Lookup before it asks vLLM again
    lookup_ttl_s: float = 2.0  # seconds a Lookup's answer stays good
    lookup_timeout_s: float | None = None  # seconds until a Lookup counts no hit; None = max(1, lookup_wait_s)
    async_loads: bool = True  # hits with blocks in T1 or T2 load in the background
    wait_timeout_s: float = 30.0  # seconds a load waits for its promotion
    timeout_s: float = 5.0  # seconds per RPC
    retry_after_s: float = 5.0  # seconds between attach attempts
    start_attach_s: float = DEFAULT_START_ATTACH_S  # seconds the engine's start waits for each Attach
    prefetch: bool = True  # a Lookup that finds blocks in T2 starts their promotion to T1

    def __post_init__(self) -> None:
        if self.lookup_timeout_s is None:
            object.__setattr__(self, "lookup_timeout_s", max(1.0, self.lookup_wait_s))
        if self.start_attach_s <= 0:
            raise ValueError(f"start_attach_s must be > 0, got {self.start_attach_s}")

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> VllmExtraConfig:
        """The settings in vLLM's `kv_connector_extra_config` (None: all defaults)."""
        extra = extra or {}
        return cls(**{field.name: _converter(field)(extra[field.name])
                      for field in dataclasses.fields(cls) if field.name in extra})


def _converter(field: dataclasses.Field) -> Callable[[Any], Any]:
    """float() for a number of seconds, bool() for a switch, the value as given for a name."""
    kind = str(field.type).split(" |")[0]  # the annotation's text: "float", "bool", "str | None"
    return {"float": float, "bool": bool}.get(kind, lambda value: value)
