"""The tenants' wrapped data keys in the shared store ([encryption] with a T3): one small record per
tenant, `<key_prefix>:tenant-key:<tenant tag hex>`, apart from the block values (theirs is
`<key_prefix>:<layout digest hex>:...`, and a layout digest is hex digits only). What a record
holds, and why every operation reads it again, is sealing/shared_tenant_keys.py's.

Records carry no expiry: they outlive the values sealed under them (retention.max_age_s and
remote.ttl_s expire values only). The store's eviction may still drop one under memory pressure
(an allkeys-* policy): that tenant's values are then misses, as after a forget, and its next write
makes a new key. A record is read by every load of its tenant, so an LRU or LFU policy keeps it.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtierd.daemon_key import TenantTag
from kvtierd.errors import FailedPrecondition
from kvtierd.t3.redis_store import RedisStore, StoreUnavailable

RECORD_INFIX = "tenant-key"


class StoreKeyRecords:
    """A KeyRecords (sealing/shared_tenant_keys.py) in the shared store. Thread-safe (the store is).
    Called from the movers', readers' and writer's threads and the forget's executor, never the loop."""

    def __init__(self, store: RedisStore) -> None:
        self.store = store
        self._head = f"{store.config.key_prefix}:{RECORD_INFIX}:".encode()

    def record_key(self, tag: TenantTag) -> bytes:
        return self._head + tag.hex().encode()

    def read(self, tags: Sequence[TenantTag]) -> list[bytes | None]:
        """Each tenant's record; None where it has none or its node did not answer (no key either way)."""
        return [bytes(value) if value is not None else None
                for value in self.store.get([self.record_key(tag) for tag in tags])]

    def create(self, tag: TenantTag, wrapped: bytes) -> bytes | None:
        key = self.record_key(tag)
        try:
            if self.store.command(key, "SET", key, wrapped, "NX"):
                return wrapped
            return self.store.command(key, "GET", key)  # another node's, stored first
        except StoreUnavailable:
            return None

    def delete(self, tag: TenantTag) -> bool:
        key = self.record_key(tag)
        try:
            return bool(self.store.command(key, "DEL", key))
        except StoreUnavailable as e:
            raise FailedPrecondition(
                f"forget: the shared store (T3) did not answer ({e}), so the tenant's shared data key is not "
                "destroyed and nothing changed; forget again when the store answers") from None
