"""Tenants' data keys: made once, wrapped at rest, bound to their tenant and master key, forgotten for good."""

from __future__ import annotations

import os
import threading

import pytest
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from kvtierd.daemon_key import TenantTag
from kvtierd.errors import FailedPrecondition
from kvtierd.sealing.key_directory import KeyDirectory
from kvtierd.sealing.master_key import MasterKey
from kvtierd.sealing.rotation import rotate_master_key
from kvtierd.sealing.tenant_keys import TenantKeys, rewrap_all, unwrap_key

MASTER = MasterKey(b"\x01" * 32)
OTHER_MASTER = MasterKey(b"\x02" * 32)
ALICE, BOB = TenantTag(b"a" * 16), TenantTag(b"b" * 16)


def keys_in(path, master: MasterKey = MASTER) -> TenantKeys:
    return TenantKeys(master, KeyDirectory.open(str(path), master))


def sealed(keys: TenantKeys, tag: TenantTag, plaintext: bytes = b"kv bytes") -> bytes:
    return keys.cipher_for_store(tag).encrypt(b"\x00" * 12, plaintext, b"")


def test_a_key_is_made_once_and_found_again_after_a_restart(tmp_path):
    """The same tenant gets the same key from a new keyring on the same directory; another tenant another."""
    first = keys_in(tmp_path)
    assert first.cipher_for_load(ALICE) is None  # nothing stored yet: nothing to open
    ciphertext = sealed(first, ALICE)
    restarted = keys_in(tmp_path)
    assert restarted.cipher_for_load(ALICE).decrypt(b"\x00" * 12, ciphertext, b"") == b"kv bytes"
    assert sealed(restarted, BOB) != ciphertext


def test_racing_first_stores_share_one_key(tmp_path):
    """Eight threads making Alice's first key at once end with one key: each one's ciphertext opens."""
    keys = keys_in(tmp_path)
    ciphers, barrier = [], threading.Barrier(8)

    def first_store():
        barrier.wait()
        ciphers.append(keys.cipher_for_store(ALICE))

    threads = [threading.Thread(target=first_store) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len({id(c) for c in ciphers}) == 1
    assert len(os.listdir(tmp_path)) == 2  # master-key-id and Alice's key


def test_the_key_file_holds_no_key_in_the_clear(tmp_path):
    """What is on disk is wrapped (the data key's bytes are not in it), 0600, and bound to its tenant."""
    keys = keys_in(tmp_path)
    ciphertext = sealed(keys, ALICE)
    path = tmp_path / f"{ALICE.hex()}.key"
    assert os.stat(path).st_mode & 0o777 == 0o600
    wrapped = path.read_bytes()
    data_key = unwrap_key(MASTER, ALICE, wrapped)
    assert data_key is not None and AESGCM(data_key).decrypt(b"\x00" * 12, ciphertext, b"") == b"kv bytes"
    assert data_key not in wrapped
    (tmp_path / f"{BOB.hex()}.key").write_bytes(wrapped)  # Alice's wrapped key under Bob's name
    assert keys_in(tmp_path).cipher_for_load(BOB) is None


def test_forget_destroys_the_key_here_and_after_a_restart(tmp_path):
    """After forget nothing sealed before opens, a restart finds no key, and a new store makes a new one."""
    keys = keys_in(tmp_path)
    ciphertext = sealed(keys, ALICE)
    bob_ciphertext = sealed(keys, BOB)
    assert keys.forget(ALICE) is True
    assert keys.forget(ALICE) is False  # nothing left to destroy
    assert keys.cipher_for_load(ALICE) is None
    restarted = keys_in(tmp_path)
    assert restarted.cipher_for_load(ALICE) is None
    assert restarted.cipher_for_load(BOB).decrypt(b"\x00" * 12, bob_ciphertext, b"") == b"kv bytes"
    with pytest.raises(InvalidTag):
        restarted.cipher_for_store(ALICE).decrypt(b"\x00" * 12, ciphertext, b"")  # a new key: the old text fails


def test_another_master_key_is_refused_at_open(tmp_path):
    """A directory whose keys another master key wrapped refuses, in one line naming both ids."""
    sealed(keys_in(tmp_path), ALICE)
    with pytest.raises(FailedPrecondition, match=f"{MASTER.key_id}.*{OTHER_MASTER.key_id}") as refused:
        keys_in(tmp_path, OTHER_MASTER)
    assert "\n" not in str(refused.value)


def test_rotation_rewraps_every_key_and_the_new_master_opens_them(tmp_path):
    """rotate_master_key: the same data keys (old ciphertext opens) under the new master key; the old
    master refused; run again, nothing to do; with the wrong old key, nothing changes."""
    directory = tmp_path / "keys"
    keys = keys_in(directory)
    ciphertexts = {tag: sealed(keys, tag) for tag in (ALICE, BOB)}
    with pytest.raises(FailedPrecondition, match="not by the old key given"):
        rotate_master_key(str(directory), MasterKey(b"\x09" * 32), OTHER_MASTER)
    assert rotate_master_key(str(directory), MASTER, OTHER_MASTER) == 2
    rotated = keys_in(directory, OTHER_MASTER)
    for tag, ciphertext in ciphertexts.items():
        assert rotated.cipher_for_load(tag).decrypt(b"\x00" * 12, ciphertext, b"") == b"kv bytes"
    with pytest.raises(FailedPrecondition):
        keys_in(directory, MASTER)
    assert rotate_master_key(str(directory), MASTER, OTHER_MASTER) == 0
    assert os.listdir(tmp_path) == ["keys"]  # no staging or previous directory left


def test_a_rotation_interrupted_between_its_renames_is_finished_by_the_next(tmp_path):
    """No `keys`, but `keys.rewrap` (new) and `keys.previous` (old): the next run swaps the new in."""
    directory = tmp_path / "keys"
    ciphertext = sealed(keys_in(directory), ALICE)
    staged = KeyDirectory.open(str(directory) + ".rewrap", OTHER_MASTER)
    rewrap_all(KeyDirectory(str(directory)), staged, MASTER, OTHER_MASTER)
    os.rename(directory, str(directory) + ".previous")
    assert rotate_master_key(str(directory), MASTER, OTHER_MASTER) == 0
    assert keys_in(directory, OTHER_MASTER).cipher_for_load(ALICE).decrypt(b"\x00" * 12, ciphertext, b"") \
        == b"kv bytes"
    assert sorted(os.listdir(tmp_path)) == ["keys"]
