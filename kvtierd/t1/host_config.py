"""The daemon file's [host] section: the host-memory tier (T1) of the node. No torch here.

One budget for the node, shared by the layouts as demand goes (t1/host_share.py): each is guaranteed
its fair share (the budget over the layouts using it), one alone may use all of it, and a layout idle
for `idle_s` lets the others take its share.
"""

from __future__ import annotations

import dataclasses

from kvtierd.config_checks import require, require_choice
from kvtierd.movers.codec_names import CODEC_NAMES
from kvtierd.units import GiB


@dataclasses.dataclass(frozen=True, slots=True)
class HostConfig:
    capacity_bytes: int = 1 * GiB  # bytes: host-memory tier (T1) of the node, shared by the layouts as demand goes
    codec: str = "raw"  # "raw" | "fp8"
    idle_s: float = 300.0  # seconds unused (no store, no load) before a layout's T1 share is open to others; 0 = never

    def __post_init__(self) -> None:
        require_choice("host.codec", self.codec, CODEC_NAMES)
        require(self.idle_s >= 0, f"host.idle_s must be >= 0 (0: a layout is never idle), got {self.idle_s}")
