"""Per-tenant usage and quota gauges, read at scrape time (for "a tenant near its quota" alerts).

`kvtierd_tenant_used_bytes{tenant,model,tier}`: what each quota limits: T0, the block references
the tenant's requests hold; T1 and T2, the tenant's resident blocks (at the pool's block size).
`kvtierd_tenant_quota_bytes{tenant,tier}`: the tenant's limit (its own, else "*", else 0 =
unlimited). Rows come from Operations.usage_rows, which scans the tiers' keys: a scrape costs
O(cached blocks), fine at Prometheus' intervals, never on a request path.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator

from prometheus_client.metrics_core import GaugeMetricFamily, Metric

from kvtierd.node.quotas import Quota
from kvtierd.tier import Tier

_USED_FIELDS = {Tier.T0: "num_t0_held_blocks", Tier.T1: "num_t1_blocks", Tier.T2: "num_t2_blocks"}


class TenantCollector:
    def __init__(self, usage_rows: Callable[[], list[dict]], quota_of: Callable[[str], Quota]) -> None:
        self._usage_rows = usage_rows
        self._quota_of = quota_of

    def collect(self) -> Iterator[Metric]:
        used = GaugeMetricFamily("kvtierd_tenant_used_bytes", "Bytes a tenant uses per pool and tier, as its quota "
                                 "counts them (t0: block references held; t1, t2: resident blocks).",
                                 labels=["tenant", "model", "tier"])
        quota = GaugeMetricFamily("kvtierd_tenant_quota_bytes", "A tenant's quota per tier in bytes (0: unlimited).",
                                  labels=["tenant", "tier"])
        retained = GaugeMetricFamily("kvtierd_tenant_retained_bytes", "Bytes of a tenant's blocks a live retention "
                                     "hint covers, per pool and tier.", labels=["tenant", "model", "tier"])
        tenants = collections.OrderedDict()
        for row in self._usage_rows():
            tenants[row["tenant"]] = None
            for tier, field in _USED_FIELDS.items():
                used.add_metric([row["tenant"], row["model_id"], tier], row[field] * row["bytes_per_block"])
                retained.add_metric([row["tenant"], row["model_id"], tier],
                                    row[f"num_{tier}_retained_blocks"] * row["bytes_per_block"])
        for tenant in tenants:
            limits = self._quota_of(tenant)
            for tier in _USED_FIELDS:
                quota.add_metric([tenant, tier], getattr(limits, f"{tier}_bytes"))
        yield used
        yield quota
        yield retained

    def describe(self) -> list[Metric]:
        return []  # families are built per scrape
