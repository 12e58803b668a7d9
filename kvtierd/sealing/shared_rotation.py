"""Master-key rotation of the shared tier's data keys: each tenant's record in the store
(t3/key_records.py) re-wrapped from the old master key to the new one where it lies, by a
compare-and-set; no value is read or written (the values are sealed under the data keys, which do
not change).

`kvtierd rewrap-keys --config` runs it after the node's own keys (rotation.py). A store has no
transaction across its nodes, so records change one by one: while it runs, and until every node of
the store runs the new key, a node of the other key finds a record foreign and treats that tenant's
T3 values as misses (never serves them, never replaces the record; shared_tenant_keys.py). Run
again, it goes on where it stopped: a record already under the new key is counted and left, one
that opens under neither key (another master key's) is left as it is.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence
from typing import Protocol

from kvtierd.daemon_key import TenantTag
from kvtierd.sealing.master_key import MasterKey
from kvtierd.sealing.tenant_keys import unwrap_key, wrap_key

MAX_ATTEMPTS = 5  # compare-and-sets of one record that may lose to a concurrent change before it counts as changed


class RotatableRecords(Protocol):
    """The store's key records, listed and replaced (t3/key_records.py); each call raises a
    KvtierError when the store did not answer, having changed nothing."""

    def tags(self) -> Sequence[TenantTag]:
        """Every tenant with a record."""
        ...

    def fetch(self, tag: TenantTag) -> bytes | None:
        """The tenant's record; None when it has none."""
        ...

    def replace(self, tag: TenantTag, expected: bytes, record: bytes) -> bool:
        """Store `record` if the tenant's record is still `expected`; whether it was."""
        ...


@dataclasses.dataclass(frozen=True)
class SharedRewrap:
    num_rewrapped: int
    num_already: int  # under the new key already (another node's rotation, or a run before)
    num_foreign: int  # opened by neither key: left as they are
    num_changed: int  # changed by someone else at every attempt (a forget, another node's new key): left


def rewrap_shared_keys(records: RotatableRecords, old: MasterKey, new: MasterKey) -> SharedRewrap:
    """Re-wrap every record of `records` that opens with `old` to `new`, in place."""
    counts = collections.Counter(_rewrap_one(records, tag, old, new) for tag in records.tags())
    return SharedRewrap(counts["rewrapped"], counts["already"], counts["foreign"], counts["changed"])


def _rewrap_one(records: RotatableRecords, tag: TenantTag, old: MasterKey, new: MasterKey) -> str:
    for _ in range(MAX_ATTEMPTS):
        record = records.fetch(tag)
        if record is None:  # forgotten meanwhile: nothing to re-wrap
            return "changed"
        data_key = unwrap_key(old, tag, record)
        if data_key is None:
            return "already" if unwrap_key(new, tag, record) is not None else "foreign"
        if records.replace(tag, record, wrap_key(new, tag, data_key)):
            return "rewrapped"
    return "changed"
