"""A sealed record opens only as the key, layout and codec it was sealed for, and a failed open leaves nothing."""

from __future__ import annotations

import os

import pytest

from kvtierd.daemon_key import DaemonKey
from kvtierd.sealing.block_seal import BlockSealer, seal_context, sealed_nbytes
from kvtierd.sealing.key_directory import KeyDirectory
from kvtierd.sealing.master_key import MasterKey
from kvtierd.sealing.tenant_keys import TenantKeys

MASTER = MasterKey(b"\x03" * 32)
ALICE_KEY = DaemonKey(b"A" * 16 + b"\x01" * 32)
PLAINTEXT = os.urandom(4096)


@pytest.fixture
def keys(tmp_path) -> TenantKeys:
    return TenantKeys(MASTER, KeyDirectory.open(str(tmp_path), MASTER))


def sealed_record(sealer: BlockSealer, key: DaemonKey = ALICE_KEY) -> bytearray:
    record = bytearray(sealed_nbytes(len(PLAINTEXT)))
    sealer.seal_into(key, memoryview(PLAINTEXT), memoryview(record))
    return record


def opened(sealer: BlockSealer, record: bytes, key: DaemonKey = ALICE_KEY) -> tuple[bool, bytes]:
    out = bytearray(b"\x5a" * len(PLAINTEXT))
    return sealer.open_into(key, memoryview(record), memoryview(out)), bytes(out)


def test_a_record_opens_as_its_own_key_and_hides_its_plaintext(keys):
    sealer = BlockSealer(keys, seal_context(b"layout-1", "raw"))
    record = sealed_record(sealer)
    assert PLAINTEXT[:32] not in record
    assert opened(sealer, record) == (True, PLAINTEXT)
    assert sealed_record(sealer)[:12] != record[:12]  # a fresh nonce per seal


@pytest.mark.parametrize("where", ["another block", "another tenant", "another layout", "another codec",
                                   "a flipped bit"])
def test_a_record_moved_or_altered_does_not_open_and_leaves_nothing(keys, where):
    """Each binding in the associated data, and the tag itself: a failed open is False with the output zeroed."""
    sealer = BlockSealer(keys, seal_context(b"layout-1", "raw"))
    record = sealed_record(sealer)
    key, reader = ALICE_KEY, sealer
    if where == "another block":
        key = DaemonKey(ALICE_KEY[:16] + b"\x02" * 32)
    elif where == "another tenant":
        key = DaemonKey(b"B" * 16 + ALICE_KEY[16:])
        keys.cipher_for_store(key[:16])  # Bob has a key of his own
    elif where == "another layout":
        reader = BlockSealer(keys, seal_context(b"layout-2", "raw"))
    elif where == "another codec":
        reader = BlockSealer(keys, seal_context(b"layout-1", "fp8"))
    else:
        record[100] ^= 1
    assert opened(reader, bytes(record), key) == (False, bytes(len(PLAINTEXT)))
