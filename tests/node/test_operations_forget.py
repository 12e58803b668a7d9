"""Forget in the node's core: the tenant's key destroyed and its blocks gone from T0, T1 and T2 when it
returns, copies that were in flight included; another tenant's blocks and key untouched."""

from __future__ import annotations

import pytest

from kvtierd.daemon_key import tenant_tag_of
from kvtierd.errors import FailedPrecondition, InvalidArgument, PermissionDenied
from kvtierd.node.operations import Operations
from kvtierd.node.pool_config import PoolConfig
from kvtierd.node.pools import PoolRegistry, PoolSettings
from kvtierd.node.quotas import QuotaBook
from kvtierd.node.sessions import SessionTable
from kvtierd.node.tenants import Tenant
from kvtierd.sealing.key_directory import KeyDirectory
from kvtierd.sealing.master_key import MasterKey
from kvtierd.sealing.tenant_keys import TenantKeys
from kvtierd.t2.ssd_config import SsdConfig
from kvtierd.tiering.tier_config import EdgePolicy, TierConfig
from kvtierd.token_bytes import pack_token_ids
from tests.factories import BLOCK_SIZE, NAMESPACE, tokens
from tests.tiering.tier_factories import LAYOUT

ADMIN, ACME, GLOBEX = Tenant.named("ops"), Tenant.named("acme"), Tenant.named("globex")
MASTER = MasterKey(b"\x05" * 32)


@pytest.fixture
def node(tmp_path):
    """A registry whose T0 writes through to T1 and T2 (sealed), and the node's keys."""
    keys = TenantKeys(MASTER, KeyDirectory.open(str(tmp_path / "keys"), MASTER))
    settings = PoolSettings(PoolConfig(device="cpu", t0_bytes=32 * LAYOUT.bytes_per_block),
                            TierConfig(host_capacity_bytes=64 * 4096, t0_to_t1=EdgePolicy("write_through"),
                                       t1_to_t2=EdgePolicy("write_through")),
                            ssd=SsdConfig(str(tmp_path / "ssd"), 64 * 8192), tenant_keys=keys)
    registry = PoolRegistry(settings)
    yield registry, keys
    registry.close()


def commit_chain(registry: PoolRegistry, tenant: Tenant, seed: int) -> None:
    """Eight blocks of `tenant` committed into T0 and released: their copies down start at once."""
    manager = registry.get_or_create(LAYOUT).manager
    prompt = tokens(seed, 8 * BLOCK_SIZE)
    keys = tenant.keys(NAMESPACE.hash_blocks(prompt))
    manager.acquire(tenant.name, keys, 0)
    manager.commit(tenant.name, 0, keys, pack_token_ids(prompt), tenant.key(registry.get_or_create(LAYOUT).client_root))
    manager.release(tenant.name)


def blocks_of(registry: PoolRegistry, tenant: Tenant) -> tuple[int, int, int]:
    tiers = registry.get_or_create(LAYOUT).manager.tiers
    assert tiers.host is not None and tiers.ssd is not None
    mine = [[k for k in keys if tenant_tag_of(k) == tenant.tag] for keys in (
        tiers.index.cached_hashes(), [e.block_hash for e in tiers.host.index.entries()], tiers.ssd.block_hashes())]
    return len(mine[0]), len(mine[1]), len(mine[2])


def operations(registry: PoolRegistry, keys: TenantKeys | None) -> Operations:
    return Operations(registry, SessionTable(30.0, QuotaBook()), admin_tenants=[ADMIN.name], tenant_keys=keys)


def test_forget_leaves_nothing_of_the_tenant_even_what_was_being_copied_down(node):
    """Forget right after the commits, with the write-through copies in flight: when it returns acme
    has no key and no block in any tier; globex's eight reach T2 and its key opens them."""
    registry, keys = node
    commit_chain(registry, GLOBEX, 100)
    commit_chain(registry, ACME, 200)
    forgotten = operations(registry, keys).forget(ADMIN, "acme")
    assert forgotten.key_destroyed and forgotten.settled
    assert blocks_of(registry, ACME) == (0, 0, 0)
    assert keys.cipher_for_load(ACME.tag) is None
    registry.get_or_create(LAYOUT).manager.drain()
    assert blocks_of(registry, ACME) == (0, 0, 0)
    assert blocks_of(registry, GLOBEX)[2] == 8 and keys.cipher_for_load(GLOBEX.tag) is not None


@pytest.mark.parametrize("caller, name, error", [
    (ADMIN, "", InvalidArgument), (ADMIN, "*", InvalidArgument), (ADMIN, " acme", InvalidArgument),
    (ACME, "acme", PermissionDenied),
])
def test_a_bad_forget_changes_nothing(node, caller, name, error):
    registry, keys = node
    commit_chain(registry, ACME, 300)
    registry.get_or_create(LAYOUT).manager.drain()
    before = blocks_of(registry, ACME)
    with pytest.raises(error):
        operations(registry, keys).forget(caller, name)
    assert blocks_of(registry, ACME) == before == (8, 8, 8)
    assert keys.cipher_for_load(ACME.tag) is not None


def test_forget_without_encryption_is_refused(node):
    registry, _ = node
    with pytest.raises(FailedPrecondition, match="forget needs encryption on"):
        operations(registry, None).forget(ADMIN, "acme")
