"""Each tenant's data key: random, made on the tenant's first sealed store, kept wrapped by the
node's master key, forgotten on request.

A data key is 32 random bytes (AES-256-GCM). At rest it is wrapped, AES-256-GCM under the master
key with the tenant's tag as associated data (a wrapped key moved to another tenant's name does
not unwrap), in a `WrappedKeyStore`: a directory beside the T2 data (key_directory.py). Forget
deletes the wrapped key there (and its copy in memory): from then on nothing sealed under it can
be opened, here or after a restart, and the tenant's next store makes a new key.

Wrapped form, `WRAPPED_BYTES` (61): version (1) | nonce (12) | wrapped key (32) | GCM tag (16).
Keys and wrapped keys never reach a log or an error: only tenant tags (a digest of the name) and
counts do.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Protocol

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from kvtierd.daemon_key import TenantTag
from kvtierd.sealing.master_key import MasterKey

log = logging.getLogger(__name__)

DATA_KEY_BYTES = 32
NONCE_BYTES = 12
GCM_TAG_BYTES = 16
WRAP_VERSION = 1
WRAPPED_BYTES = 1 + NONCE_BYTES + DATA_KEY_BYTES + GCM_TAG_BYTES
_WRAP_DOMAIN = b"kvtierd-data-key-v1\x00"


class WrappedKeyStore(Protocol):
    """Where wrapped data keys live, by tenant tag. `delete` is durable when it returns."""

    def read(self, tag: TenantTag) -> bytes | None: ...

    def write(self, tag: TenantTag, wrapped: bytes) -> None: ...

    def delete(self, tag: TenantTag) -> bool: ...

    def tags(self) -> list[TenantTag]: ...


def wrap_key(master: MasterKey, tag: TenantTag, data_key: bytes) -> bytes:
    nonce = os.urandom(NONCE_BYTES)
    return bytes([WRAP_VERSION]) + nonce + AESGCM(master.key_bytes).encrypt(nonce, data_key, _WRAP_DOMAIN + tag)


def unwrap_key(master: MasterKey, tag: TenantTag, wrapped: bytes) -> bytes | None:
    """The data key, or None when `wrapped` is not this tenant's key under this master key."""
    if len(wrapped) != WRAPPED_BYTES or wrapped[0] != WRAP_VERSION:
        return None
    nonce, sealed = wrapped[1:1 + NONCE_BYTES], wrapped[1 + NONCE_BYTES:]
    try:
        return AESGCM(master.key_bytes).decrypt(nonce, sealed, _WRAP_DOMAIN + tag)
    except InvalidTag:
        return None


class TenantKeys:
    """The node's data keys. Thread-safe.

    Invariants: `_ciphers[tag]` exists only while the store holds that tenant's wrapped key (a
    forget drops both under `_lock`); a tenant has at most one data key at a time, because the
    make-and-write of a new key runs under `_lock` (a rare write of 61 bytes, once per tenant and
    key, held across that I/O on purpose: two stores racing must not seal under two keys).
    """

    def __init__(self, master: MasterKey, store: WrappedKeyStore) -> None:
        self._master = master
        self._store = store
        self._ciphers: dict[TenantTag, AESGCM] = {}  # under _lock
        self._lock = threading.Lock()
        self.num_forgotten = 0  # forgets that destroyed a key, since start

    def cipher_for_store(self, tag: TenantTag) -> AESGCM:
        """The tenant's data key, made (and stored wrapped) when it has none."""
        cipher = self._ciphers.get(tag)
        if cipher is not None:
            return cipher
        with self._lock:
            cipher = self._ciphers.get(tag) or self._read(tag)
            if cipher is None:
                data_key = AESGCM.generate_key(bit_length=8 * DATA_KEY_BYTES)
                self._store.write(tag, wrap_key(self._master, tag, data_key))
                cipher = AESGCM(data_key)
            self._ciphers[tag] = cipher
            return cipher

    def cipher_for_load(self, tag: TenantTag) -> AESGCM | None:
        """The tenant's data key; None when it has none (never made, or forgotten): nothing to open."""
        cipher = self._ciphers.get(tag)
        if cipher is not None:
            return cipher
        with self._lock:
            cipher = self._ciphers.get(tag) or self._read(tag)
            if cipher is not None:
                self._ciphers[tag] = cipher
            return cipher

    def forget(self, tag: TenantTag) -> bool:
        """Destroy the tenant's data key, durably; True if it had one."""
        with self._lock:
            self._ciphers.pop(tag, None)
            existed = self._store.delete(tag)
        if existed:
            self.num_forgotten += 1
        return existed

    def _read(self, tag: TenantTag) -> AESGCM | None:
        wrapped = self._store.read(tag)
        if wrapped is None:
            return None
        data_key = unwrap_key(self._master, tag, wrapped)
        if data_key is None:
            log.warning("encryption: the data key of tenant tag %s does not unwrap; its blocks are misses", tag.hex())
            return None
        return AESGCM(data_key)


def rewrap_all(source: WrappedKeyStore, target: WrappedKeyStore, old: MasterKey,
               new: MasterKey) -> tuple[int, list[TenantTag]]:
    """Master-key rotation: each wrapped key of `source` unwrapped with `old`, wrapped with `new`,
    written to `target` (the blocks are not touched). Returns (keys rewrapped, tags that did not
    unwrap with `old`, not written)."""
    num_rewrapped, failed = 0, []
    for tag in source.tags():
        wrapped = source.read(tag)
        data_key = None if wrapped is None else unwrap_key(old, tag, wrapped)
        if data_key is None:
            failed.append(tag)
            continue
        target.write(tag, wrap_key(new, tag, data_key))
        num_rewrapped += 1
    return num_rewrapped, failed
