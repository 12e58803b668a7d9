"""The operator's evict: from T0 alone blocks are copied down first; an evict that names a lower
tier as well leaves nothing behind, not even a copy landing after it returns."""

from __future__ import annotations

import pytest

from kvtierd.node.operations import Operations
from kvtierd.node.pool_config import PoolConfig
from kvtierd.node.pools import PoolRegistry, PoolSettings
from kvtierd.node.quotas import QuotaBook
from kvtierd.node.sessions import SessionTable
from kvtierd.node.tenants import Tenant
from kvtierd.tiering.tier_config import TierConfig
from kvtierd.token_bytes import pack_token_ids
from tests.factories import BLOCK_SIZE, NAMESPACE, tokens
from tests.tiering.tier_factories import LAYOUT

ADMIN = Tenant.named("ops")


@pytest.fixture
def registry():
    settings = PoolSettings(PoolConfig(device="cpu", t0_bytes=8 * LAYOUT.bytes_per_block),
                            TierConfig(host_capacity_bytes=32 * 4096))
    registry = PoolRegistry(settings)
    pool = registry.get_or_create(LAYOUT)
    manager, prompt = pool.manager, tokens(7, 4 * BLOCK_SIZE)
    keys = ADMIN.keys(NAMESPACE.hash_blocks(prompt))
    manager.acquire("a", keys, 0)
    manager.commit("a", 0, keys, pack_token_ids(prompt), ADMIN.key(pool.client_root))  # 4 blocks in T0
    manager.release("a")
    manager.drain()
    yield registry
    registry.close()


def evict(registry: PoolRegistry, tiers: list[str]):
    """Evict every tenant's blocks from `tiers`, then wait for any copy it started to land."""
    operations = Operations(registry, SessionTable(30.0, QuotaBook()), admin_tenants=[ADMIN.name])
    counts = operations.evict(ADMIN, "", True, tiers)
    registry.get(LAYOUT).manager.drain()
    return counts


def blocks_per_tier(registry: PoolRegistry) -> tuple[int, int]:
    tiers = registry.get(LAYOUT).manager.tiers
    return len(tiers.index.cached_hashes()), len(list(tiers.host.index.entries()))


def test_an_evict_of_t0_alone_copies_the_blocks_down_to_t1(registry):
    assert blocks_per_tier(registry) == (4, 0)
    assert evict(registry, ["t0"]).t0 == 4
    assert blocks_per_tier(registry) == (0, 4)


@pytest.mark.parametrize("tiers", [["t0", "t1"], ["t0", "t1", "t2"], []])
def test_an_evict_naming_a_lower_tier_leaves_no_copy_behind(registry, tiers):
    assert evict(registry, tiers).t0 == 4
    assert blocks_per_tier(registry) == (0, 0)
