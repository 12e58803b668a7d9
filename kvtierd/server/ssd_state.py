"""The node's SSD tier (T2) as a whole: on, off by choice, or wanted and off for want of room; and
what health says of it.

T2 is off by choice with `ssd.directory = ""`, or `ssd.capacity_bytes = 0` given by the operator.
Otherwise it is wanted: a directory with a budget — the one given, or, when none is, the default
bounded by the disk (t2/ssd_space.py), which comes out 0 when the disk has too little room. A
directory the operator named without that room is refused at start (startup_checks.py); the
default directory without it leaves the node running without T2, which start-up, Stats
(`StatsResponse.ssd.problem`), `kvtierctl health` and the gRPC health service name
SSD_HEALTH_NAME report as a problem. Each layout's T2 can fail on its own later (a full disk,
I/O errors: it stops admitting, PoolStats.t2_admitting); health reports that too.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from grpc_health.v1 import health_pb2

from kvtierd.server.config_flags import setting_name
from kvtierd.server.daemon_config import DaemonConfig
from kvtierd.t2.ssd_probe import DirectoryProbe
from kvtierd.t2.ssd_space import DEFAULT_FREE_FRACTION, MIN_DEFAULT_BUDGET_BYTES, free_bytes
from kvtierd.v1 import kvtier_pb2 as pb

if TYPE_CHECKING:
    from kvtierd.node.pools import LayoutPool

SSD_HEALTH_NAME = "kvtierd.v1.SsdTier"  # a health service name: SERVING while T2 is on and every layout's admits
SSD_HEALTH_INTERVAL_S = 1.0  # how often its status follows the layouts' T2


def off_by_choice(config: DaemonConfig) -> bool:
    """The operator turned T2 off: no directory, or a budget of 0 they gave."""
    ssd = config.ssd
    return not ssd.directory or (ssd.capacity_bytes == 0 and "ssd.capacity_bytes" in config.given_keys)


def no_room_problem(config: DaemonConfig) -> str:
    """Why T2 is off although wanted (a default budget found no room), naming the directory and what
    to do; "" when T2 is on or off by choice."""
    from kvtierd.planning.capacity import format_bytes  # imports torch, which the client must not pay for

    if config.ssd.enabled or off_by_choice(config):
        return ""
    directory = config.ssd.directory
    free = free_bytes(directory)
    found = f"its filesystem has {format_bytes(free)} free" if free is not None else "its free space is unknown"
    capacity = setting_name("ssd.capacity_bytes")
    return (f"no room for T2 in {directory}: {found}; a default budget ({capacity} not set) is "
            f"{DEFAULT_FREE_FRACTION:.0%} of the free space and at least {format_bytes(MIN_DEFAULT_BUDGET_BYTES)}: "
            f"free space there, set {capacity} to what fits, or {setting_name('ssd.directory')} to '' to run "
            "without T2")


def failing_layouts(pools: Iterable[LayoutPool]) -> list[str]:
    """The model ids of the layouts whose T2 stopped admitting blocks."""
    return [pool.layout.model_id for pool in pools
            if pool.manager.tiers.ssd is not None and not pool.manager.tiers.ssd.admitting]


class SsdHealth:
    """The status of SSD_HEALTH_NAME in a grpc.health.v1 servicer: SERVING while the node's T2 works,
    NOT_SERVING while it runs without the T2 it wants (`problem`) or a layout's T2 does not admit.
    Not reported (NOT_FOUND) where T2 is off by choice: the daemon does not create one then."""

    def __init__(self, health: Any, config: DaemonConfig, problem: str,
                 pools: Callable[[], Iterable[LayoutPool]]) -> None:
        assert not off_by_choice(config)
        self.health, self.problem, self.pools = health, problem, pools

    @property
    def serving(self) -> bool:
        return not self.problem and not failing_layouts(self.pools())

    async def update(self) -> None:
        """Set the status now; it reads flags only (no disk)."""
        status = health_pb2.HealthCheckResponse
        await self.health.set(SSD_HEALTH_NAME, status.SERVING if self.serving else status.NOT_SERVING)

    async def follow(self, interval_s: float = SSD_HEALTH_INTERVAL_S) -> None:
        """update() every `interval_s` until cancelled."""
        while True:
            await asyncio.sleep(interval_s)
            await self.update()


def node_ssd_message(config: DaemonConfig, problem: str, probe: DirectoryProbe | None) -> pb.SsdStats:
    """StatsResponse.ssd: the node's T2 as start-up found it."""
    ssd = config.ssd
    return pb.SsdStats(enabled=ssd.enabled, directory=ssd.directory if not off_by_choice(config) else "",
                       problem=problem, o_direct_refused=probe.o_direct_refused if probe is not None else "")
