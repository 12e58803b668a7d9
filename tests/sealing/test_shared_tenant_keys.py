"""SharedTenantKeys: the nodes of one master key share each tenant's T3 data key through the store's
records; the record in the store is the truth on every call (a forget elsewhere is seen at once);
a record another master key wrapped is no key here and is never replaced."""

from __future__ import annotations

import os
from collections.abc import Sequence

import pytest
from cryptography.exceptions import InvalidTag

from kvtierd.daemon_key import TenantTag
from kvtierd.errors import FailedPrecondition
from kvtierd.sealing.master_key import MasterKey
from kvtierd.sealing.shared_tenant_keys import SharedTenantKeys

ACME = TenantTag(b"a" * 16)
GLOBEX = TenantTag(b"g" * 16)
NONCE = bytes(12)


class DictRecords:
    """The store's records as a dict: create is SET NX then GET; `answering` False: the store is down."""

    def __init__(self) -> None:
        self.records: dict[TenantTag, bytes] = {}
        self.answering = True

    def record_key(self, tag: TenantTag) -> bytes:
        return b"kvtierd:tenant-key:" + tag.hex().encode()

    def read(self, tags: Sequence[TenantTag]) -> list[bytes | None]:
        return [self.records.get(tag) if self.answering else None for tag in tags]

    def create(self, tag: TenantTag, wrapped: bytes) -> bytes | None:
        if not self.answering:
            return None
        return self.records.setdefault(tag, wrapped)

    def delete(self, tag: TenantTag) -> bool:
        if not self.answering:
            raise FailedPrecondition("forget: the shared store (T3) did not answer")
        return self.records.pop(tag, None) is not None


def node(records: DictRecords, master: MasterKey | None = None) -> SharedTenantKeys:
    return SharedTenantKeys(master or MasterKey(b"m" * 32), records)


def test_a_key_made_on_one_node_opens_on_another_of_the_same_master_key():
    records = DictRecords()
    a, b = node(records), node(records)
    sealing = a.cipher_to_seal(ACME, None)
    assert sealing is not None and set(records.records) == {ACME}
    opening = b.cipher_of(ACME, records.records[ACME])
    assert opening is not None
    assert opening.decrypt(NONCE, sealing.encrypt(NONCE, b"block", b"ad"), b"ad") == b"block"
    assert records.records[ACME] not in repr(a.__dict__).encode()  # the record is bytes, never formatted


def test_two_nodes_racing_to_make_a_key_end_with_the_one_the_store_took():
    """Both saw no record; the second's SET NX loses and it seals with the first's key."""
    records = DictRecords()
    a, b = node(records), node(records)
    first = a.cipher_to_seal(ACME, None)
    second = b.cipher_to_seal(ACME, None)  # its view was taken before a's write
    assert first is not None and second is not None
    assert second.decrypt(NONCE, first.encrypt(NONCE, b"x", None), None) == b"x"
    assert len(records.records) == 1


def test_after_a_forget_on_one_node_the_other_opens_nothing_and_drops_the_key():
    records = DictRecords()
    a, b = node(records), node(records)
    a.cipher_to_seal(ACME, None)
    a.cipher_to_seal(GLOBEX, None)
    old_record = records.records[ACME]
    old = b.cipher_of(ACME, old_record)
    assert old is not None
    sealed = old.encrypt(NONCE, b"acme's block", None)
    assert a.forget(ACME) is True and a.forget(ACME) is False
    assert b.cipher_of(ACME, records.read([ACME])[0]) is None
    assert ACME not in b._opened  # nothing of the old key kept in memory
    assert b.cipher_of(GLOBEX, records.records[GLOBEX]) is not None  # another tenant untouched
    new = b.cipher_to_seal(ACME, None)  # the tenant's next write makes a new key
    assert new is not None and records.records[ACME] != old_record
    with pytest.raises(InvalidTag):
        new.decrypt(NONCE, sealed, None)


def test_a_record_of_another_master_key_is_no_key_here_and_is_not_replaced():
    records = DictRecords()
    node(records, MasterKey(b"m" * 32)).cipher_to_seal(ACME, None)
    theirs = records.records[ACME]
    other = node(records, MasterKey(b"o" * 32))
    assert other.cipher_of(ACME, theirs) is None
    assert other.cipher_to_seal(ACME, records.read([ACME])[0]) is None
    assert records.records[ACME] == theirs and other.num_foreign_records == 1  # one record, counted once


def test_a_record_moved_to_another_tenant_does_not_unwrap():
    records = DictRecords()
    a = node(records)
    a.cipher_to_seal(ACME, None)
    assert a.cipher_of(GLOBEX, records.records[ACME]) is None


def test_a_forget_the_store_does_not_confirm_changes_nothing():
    records = DictRecords()
    a = node(records)
    a.cipher_to_seal(ACME, None)
    record = records.records[ACME]
    records.answering = False
    with pytest.raises(FailedPrecondition, match="did not answer"):
        a.forget(ACME)
    records.answering = True
    assert records.records[ACME] == record and a._opened[ACME][0] == record


def test_no_key_is_made_while_the_store_does_not_answer():
    records = DictRecords()
    records.answering = False
    assert node(records).cipher_to_seal(ACME, None) is None
    assert records.records == {}


def test_a_record_of_random_bytes_is_no_key():
    assert node(DictRecords()).cipher_of(ACME, os.urandom(61)) is None
