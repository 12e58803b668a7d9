"""Each tenant's data key for the shared tier (T3), kept wrapped in the shared store, so that every
node started with the same master key seals and opens the tenant's T3 values with the same key.

The store holds one record per tenant (t3/key_records.py), the data key wrapped as tenant_keys.py
wraps it: AES-256-GCM under the master key, the tenant's tag as associated data (a record copied
to another tenant's name does not unwrap). The record in the store is the truth, and it is read
again by every operation that uses it: a T3 load GETs it beside its blocks (the same round trip),
a write batch before it seals. A node never opens a tenant's value with a key the store no longer
holds, so a forget on any node (the record deleted) makes the tenant's T3 values unreadable on
every node at once, whatever the others held in memory; their next operation of the tenant finds
no record and drops the key from memory.

A new key is made by the first node that writes the tenant's blocks: SET NX, and the loser of a
race takes the winner's record, so a tenant has one key on every node. A record that does not
unwrap (another master key wrapped it, or it was altered) is no key for this node: the tenant's
T3 values are misses here, its blocks are not written to T3 from here, and the record is never
replaced (the nodes of that master key still use it). One warning per tenant tag says so.

Keys and records never reach a log or an error: only tenant tags and counts do.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Protocol

from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from kvtierd.daemon_key import TenantTag
from kvtierd.sealing.master_key import MasterKey
from kvtierd.sealing.tenant_keys import DATA_KEY_BYTES, unwrap_key, wrap_key

log = logging.getLogger(__name__)


class KeyRecords(Protocol):
    """The wrapped data keys in the shared store, by tenant tag (t3/key_records.py)."""

    def record_key(self, tag: TenantTag) -> bytes:
        """The store key of the tenant's record."""
        ...

    def read(self, tags: Sequence[TenantTag]) -> list[bytes | None]:
        """Each tenant's record; None where it has none or the store did not answer."""
        ...

    def create(self, tag: TenantTag, wrapped: bytes) -> bytes | None:
        """Store `wrapped` unless the tenant has a record; the record the store holds then (ours or
        the one that was there), None when the store did not answer."""
        ...

    def delete(self, tag: TenantTag) -> bool:
        """Remove the tenant's record; True if it had one. Raises (a KvtierError) when the store did
        not confirm it, having changed nothing."""
        ...


class SharedTenantKeys:
    """The data keys of T3, as the store's records hold them. Thread-safe.

    Invariant: `_opened[tag]` is the cipher of the last record of that tenant an operation
    presented (`cipher_of`), or absent once one found none; so a node keeps in memory only the key
    its latest look at the store saw.
    """

    def __init__(self, master: MasterKey, records: KeyRecords) -> None:
        self.master = master
        self.records = records
        self._opened: dict[TenantTag, tuple[bytes, AESGCM | None]] = {}  # tag -> (record, its cipher); under _lock
        self._warned: set[TenantTag] = set()  # tenants whose record did not unwrap (warned once)
        self._lock = threading.Lock()
        self.num_foreign_records = 0  # records that did not unwrap with this master key, each counted once

    def cipher_of(self, tag: TenantTag, record: bytes | None) -> AESGCM | None:
        """The key of the tenant's record as the store holds it now (`record`, None: no record);
        None when there is none or it does not unwrap here."""
        with self._lock:
            if record is None:
                self._opened.pop(tag, None)
                return None
            known = self._opened.get(tag)
            if known is not None and known[0] == record:
                return known[1]
            data_key = unwrap_key(self.master, tag, record)
            cipher = AESGCM(data_key) if data_key is not None else None
            self._opened[tag] = (record, cipher)
            if cipher is None:
                self.num_foreign_records += 1
                if tag not in self._warned:
                    self._warned.add(tag)
                    log.warning("encryption: the shared data key of tenant tag %s does not unwrap with this master "
                                "key (another master key wrapped it?): its T3 blocks are misses on this node",
                                tag.hex())
            return cipher

    def cipher_to_seal(self, tag: TenantTag, record: bytes | None) -> AESGCM | None:
        """The key to seal the tenant's values with, given its record as the store holds it now:
        a new key made and stored (or the one a racing node stored first) when it has none; None
        when the store did not answer or the record does not unwrap here."""
        if record is None:
            data_key = AESGCM.generate_key(bit_length=8 * DATA_KEY_BYTES)
            record = self.records.create(tag, wrap_key(self.master, tag, data_key))
        return self.cipher_of(tag, record)

    def forget(self, tag: TenantTag) -> bool:
        """Delete the tenant's record in the store (every node's next look finds none) and its key
        here; True if it had one. Raises, changing nothing, when the store did not confirm it."""
        existed = self.records.delete(tag)
        with self._lock:
            self._opened.pop(tag, None)
        return existed
