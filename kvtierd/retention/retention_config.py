"""The daemon file's [retention] section: how long a retention hint may live and how much of a
tier one tenant's hints may hold. No torch here."""

from __future__ import annotations

import dataclasses
import math

from kvtierd.config_checks import require


@dataclasses.dataclass(frozen=True, slots=True)
class RetentionConfig:
    max_ttl_s: float = 86400.0  # seconds: the longest ttl_s a hint may ask for
    # a fraction of each tier's capacity (T1: the layout's current share) one tenant's retained blocks may hold
    max_tenant_share: float = 0.5
    # seconds since its store after which a T2 (SSD) block is a miss and reclaimed, and a T3 value expires in
    # the store (with remote.ttl_s, the smaller); 0 = no limit
    max_age_s: float = 0.0

    def __post_init__(self) -> None:
        require(math.isfinite(self.max_age_s) and self.max_age_s >= 0,
                f"retention.max_age_s must be a finite number of seconds >= 0 (0: no limit), got {self.max_age_s}")
        require(math.isfinite(self.max_ttl_s) and self.max_ttl_s > 0,
                f"retention.max_ttl_s must be a finite number of seconds > 0, got {self.max_ttl_s}")
        require(0 <= self.max_tenant_share <= 1,
                f"retention.max_tenant_share must be a fraction in [0, 1] (0: no hint is kept), "
                f"got {self.max_tenant_share}")
