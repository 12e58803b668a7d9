"""DaemonKey: a tenant's tag, then the client's hash; packing and unpacking are inverse."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtierd.daemon_key import (
    TAG_BYTES,
    client_hash_of,
    daemon_key_size,
    make_daemon_key,
    make_daemon_keys,
    tenant_tag_of,
)
from kvtierd.node.tenants import Tenant


@given(name=st.text(max_size=20), client_hash=st.binary(min_size=16, max_size=32))
def test_a_key_unpacks_into_its_tenant_tag_and_client_hash(name, client_hash):
    tenant = Tenant.named(name)
    key = tenant.key(client_hash)
    assert len(key) == daemon_key_size(len(client_hash))
    assert tenant_tag_of(key) == tenant.tag
    assert client_hash_of(key) == client_hash
    assert tenant.keys([client_hash, client_hash]) == [key, key] == make_daemon_keys(tenant.tag, [client_hash] * 2)


def test_two_tenants_key_one_hash_differently():
    client_hash = bytes(range(32))
    alice, bob = Tenant.named("alice"), Tenant.named("bob")
    assert alice.key(client_hash) != bob.key(client_hash)
    assert tenant_tag_of(alice.key(client_hash)) != tenant_tag_of(bob.key(client_hash))
    assert len(alice.tag) == TAG_BYTES and Tenant.named("alice").tag == alice.tag  # a fixed function of the name


def test_a_tag_of_the_wrong_size_is_refused():
    with pytest.raises(AssertionError):
        make_daemon_key(b"short", bytes(32))
