"""What moves between tiers and when: edge policies, capacities, codecs, the recompute cost; the
daemon file's [policy] section (PolicyConfig) and the TierConfig a layout's tiers are built with.

Per edge (T0→T1, T1→T2, and into the shared tier T3 from T1 or from T2):
- `write_through`: committed blocks are copied down in the background at once, so a later
  eviction from the upper tier costs nothing (the lower tier already holds the block);
- `on_evict`: a block is copied down when the upper tier evicts it;
- `off`: nothing moves down this edge.
A write-through edge writes every block or counts it: a block waits for room in the tier below
(its copy held in the tier above) at most `write_through_wait_s` (write_through.py), then is
dropped from the edge and counted.
A lower-tier hit is loaded only when loading is expected to be faster than recomputing those
tokens (load_decision.py), at the cost the layout's engines measure and report
(recompute_cost.py); `recompute_s_per_token` overrides that measurement.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import TYPE_CHECKING

from kvtierd.config_checks import require, require_choice
from kvtierd.errors import InvalidArgument
from kvtierd.index.eviction_order import EVICTION_ORDERS
from kvtierd.layout import FLOAT_DTYPES, Layout
from kvtierd.retention.retention_config import RetentionConfig
from kvtierd.tier import Edge

if TYPE_CHECKING:
    from kvtierd.t1.host_config import HostConfig
    from kvtierd.t2.ssd_config import SsdConfig
    from kvtierd.t3.remote_config import RemoteConfig


class LayoutCost(enum.Enum):
    """The default of a per-call `recompute_s_per_token`: the layout's (its config's override, else
    its engines' measurement: recompute_cost.py)."""

    LAYOUT_COST = "the layout's"


LAYOUT_COST = LayoutCost.LAYOUT_COST


class EdgePolicy(str, enum.Enum):
    WRITE_THROUGH = "write_through"
    ON_EVICT = "on_evict"
    OFF = "off"


EDGE_POLICIES = tuple(policy.value for policy in EdgePolicy)
T2_TO_T3_POLICIES = (EdgePolicy.WRITE_THROUGH.value, EdgePolicy.OFF.value)  # T2's victims are overwritten in place


@dataclasses.dataclass(frozen=True, slots=True)
class PolicyConfig:
    """[policy]: the edges as the daemon's file spells them (strings); TierConfig holds them as EdgePolicy."""

    t0_to_t1: str = "on_evict"  # "write_through" | "on_evict" | "off"
    t1_to_t2: str = "write_through"  # "write_through" | "on_evict" | "off"
    recompute_s_per_token: float = 0.0  # seconds per token, overriding the engines' measurement; 0 = measured
    t1_to_t3: str = "write_through"  # into T3 (with remote.endpoints): "write_through" | "on_evict" | "off"
    t2_to_t3: str = "off"  # "write_through" | "off"
    # seconds a block on a write-through edge may wait for room in the tier below (held above meanwhile;
    # a Put waits as long for room in T0) before it is dropped from the edge, counted; 0 = never wait
    write_through_wait_s: float = 10.0
    # the order in which each tier evicts blocks without a live retention hint: "lru" | "s3fifo"
    # (index/eviction_order.py); retained blocks leave by class, then LRU, whichever
    t0_eviction: str = "lru"
    t1_eviction: str = "lru"
    t2_eviction: str = "lru"

    def __post_init__(self) -> None:
        require(math.isfinite(self.recompute_s_per_token) and self.recompute_s_per_token >= 0,
                "policy.recompute_s_per_token must be a finite number >= 0 (0: the engines' measurement)")
        require(math.isfinite(self.write_through_wait_s) and self.write_through_wait_s >= 0,
                "policy.write_through_wait_s must be a finite number of seconds >= 0 (0: never wait)")
        for name in ("t0_to_t1", "t1_to_t2", "t1_to_t3"):
            require_choice(f"policy.{name}", getattr(self, name), EDGE_POLICIES)
        require_choice("policy.t2_to_t3", self.t2_to_t3, T2_TO_T3_POLICIES)
        for name in ("t0_eviction", "t1_eviction", "t2_eviction"):
            require_choice(f"policy.{name}", getattr(self, name), EVICTION_ORDERS)


_POLICY = PolicyConfig()  # TierConfig's edges default to the daemon's


@dataclasses.dataclass(frozen=True)
class TierConfig:
    host_capacity_bytes: int = 1 << 30
    host_codec: str = "raw"  # "raw" | "fp8"
    host_idle_s: float = 300.0  # a layout's T1 unused this long lets the others take its share (HostConfig.idle_s)
    ssd_codec: str = "raw"  # T2 may store fp8 below a raw T1 (converted on the host)
    t0_to_t1: EdgePolicy = EdgePolicy(_POLICY.t0_to_t1)
    t1_to_t2: EdgePolicy = EdgePolicy(_POLICY.t1_to_t2)
    t1_to_t3: EdgePolicy = EdgePolicy(_POLICY.t1_to_t3)  # with a T3 store only: what T1 takes goes on to T3
    t2_to_t3: EdgePolicy = EdgePolicy(_POLICY.t2_to_t3)  # write_through: what T2 takes goes on to T3 as well
    remote_codec: str = "raw"  # what T3 values hold ("raw" | "fp8")
    recompute_s_per_token: float | None = None  # the operator's override; None: the engines' measurement
    write_through_wait_s: float = _POLICY.write_through_wait_s  # the longest wait for room below (PolicyConfig)
    retention: RetentionConfig = RetentionConfig()  # the bounds of retention hints ([retention])
    t0_eviction: str = _POLICY.t0_eviction  # each tier's order for blocks without a live hint (PolicyConfig)
    t1_eviction: str = _POLICY.t1_eviction
    t2_eviction: str = _POLICY.t2_eviction

    @classmethod
    def of_sections(cls, host: HostConfig, ssd: SsdConfig, policy: PolicyConfig, remote: RemoteConfig,
                    retention: RetentionConfig = RetentionConfig()) -> TierConfig:
        """The daemon file's sections as a layout's tiers take them; `host.capacity_bytes` is the
        node's T1 budget here (each pool gets its share, node/pools.py)."""
        return cls(host_capacity_bytes=host.capacity_bytes, host_codec=host.codec, host_idle_s=host.idle_s,
                   ssd_codec=ssd.codec,
                   t0_to_t1=EdgePolicy(policy.t0_to_t1), t1_to_t2=EdgePolicy(policy.t1_to_t2),
                   t1_to_t3=EdgePolicy(policy.t1_to_t3), t2_to_t3=EdgePolicy(policy.t2_to_t3),
                   remote_codec=remote.codec,
                   recompute_s_per_token=policy.recompute_s_per_token or None,
                   write_through_wait_s=policy.write_through_wait_s, retention=retention,
                   t0_eviction=policy.t0_eviction, t1_eviction=policy.t1_eviction, t2_eviction=policy.t2_eviction)

    def __post_init__(self) -> None:
        if self.host_capacity_bytes < 0:
            raise InvalidArgument(f"host_capacity_bytes must be >= 0, got {self.host_capacity_bytes}")
        for name in ("t0_to_t1", "t1_to_t2", "t1_to_t3", "t2_to_t3"):
            object.__setattr__(self, name, EdgePolicy(getattr(self, name)))
        if self.t2_to_t3 is EdgePolicy.ON_EVICT:
            raise InvalidArgument("t2_to_t3 = on_evict is not supported: use write_through (T2's victims are "
                                  "overwritten in place), or t1_to_t3")
        if self.recompute_s_per_token is not None and self.recompute_s_per_token <= 0:
            raise InvalidArgument("recompute_s_per_token must be positive")
        if not (math.isfinite(self.write_through_wait_s) and self.write_through_wait_s >= 0):
            raise InvalidArgument(f"write_through_wait_s must be a finite number >= 0, got {self.write_through_wait_s}")
        for name in ("t0_eviction", "t1_eviction", "t2_eviction"):
            require_choice(name, getattr(self, name), EVICTION_ORDERS)

    def policy(self, edge: Edge) -> EdgePolicy:
        """The policy of one edge."""
        return {Edge.T0_T1: self.t0_to_t1, Edge.T1_T2: self.t1_to_t2, Edge.T1_T3: self.t1_to_t3,
                Edge.T2_T3: self.t2_to_t3}[edge]

    def for_layout(self, layout: Layout) -> TierConfig:
        """This config as `layout`'s tiers apply it: fp8 quantizes K and V values, so a layout of
        opaque pages (uint8: MLA latents, linear-attention state) keeps raw bytes in every tier."""
        if layout.dtype in FLOAT_DTYPES:
            return self
        return dataclasses.replace(self, host_codec="raw", ssd_codec="raw", remote_codec="raw")

