"""PoolRegistry: one pool per layout, and one copy engine per device shared by the pools on it."""

from __future__ import annotations

import pytest

from kvtierd.errors import ResourceExhausted
from kvtierd.layout import Layout
from kvtierd.node.pool_config import PoolConfig
from kvtierd.node.pools import PoolRegistry, PoolSettings
from kvtierd.tiering.tier_config import TierConfig

SMALL = Layout("pools-a", 1, 1, 8, 4)
OTHER = Layout("pools-b", 2, 1, 8, 4)


def registry(max_layouts: int = 4) -> PoolRegistry:
    settings = PoolSettings(PoolConfig(device="cpu", t0_bytes=8 * OTHER.bytes_per_block, max_layouts=max_layouts),
                            TierConfig(host_capacity_bytes=1 << 16))
    return PoolRegistry(settings)


def test_two_layouts_on_one_device_share_one_copy_engine_until_the_last_closes():
    pools = registry()
    first, second = pools.get_or_create(SMALL), pools.get_or_create(OTHER)
    assert first is not second and pools.get_or_create(SMALL) is first  # one pool per layout
    engine = first.manager.tiers.engine
    assert second.manager.tiers.engine is engine and pools.engines.num_users("cpu") == 2
    pools.close()
    assert engine.closed and pools.engines.num_users("cpu") == 0


def test_closing_one_manager_leaves_the_shared_engine_to_the_other():
    pools = registry()
    first, second = pools.get_or_create(SMALL), pools.get_or_create(OTHER)
    first.close()
    engine = second.manager.tiers.engine
    assert not engine.closed and pools.engines.num_users("cpu") == 1
    pools.close()
    assert engine.closed


def test_a_layout_beyond_max_layouts_is_refused_and_changes_nothing():
    pools = registry(max_layouts=1)
    pools.get_or_create(SMALL)
    with pytest.raises(ResourceExhausted):
        pools.get_or_create(OTHER)
    assert [p.layout for p in pools.pools()] == [SMALL] and pools.engines.num_users("cpu") == 1
    pools.close()
