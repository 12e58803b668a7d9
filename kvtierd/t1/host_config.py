"""The daemon file's [host] section: the host-memory tier (T1) of the node. No torch here.

One budget for the node: each layout's slab is a share fixed when its pool is created,
`capacity_bytes / pool.max_layouts` in whole slots (node/pools.py).
"""

from __future__ import annotations

import dataclasses

from kvtierd.config_checks import require_choice
from kvtierd.movers.codec_names import CODEC_NAMES
from kvtierd.units import GiB


@dataclasses.dataclass(frozen=True, slots=True)
class HostConfig:
    capacity_bytes: int = 1 * GiB  # bytes: host-memory tier (T1) of the node, split evenly over pool.max_layouts
    codec: str = "raw"  # "raw" | "fp8"

    def __post_init__(self) -> None:
        require_choice("host.codec", self.codec, CODEC_NAMES)
