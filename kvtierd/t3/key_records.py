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

import redis

from kvtierd.daemon_key import TenantTag
from kvtierd.errors import FailedPrecondition
from kvtierd.t3.redis_store import RedisStore, StoreUnavailable

RECORD_INFIX = "tenant-key"
SCAN_COUNT = 1000  # keys a SCAN step looks at
# SET the record to ARGV[2] only while it is still ARGV[1] (a forget or another node's change wins).
_COMPARE_AND_SET = ("if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('SET', KEYS[1], ARGV[2]) return 1 end "
                    "return 0")


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

    def tags(self) -> list[TenantTag]:
        """Every tenant with a record, from a SCAN of each node that owns slots (master-key rotation:
        sealing/shared_rotation.py). FailedPrecondition when the store or one of its nodes did not answer."""
        try:
            if self.store.topology.slot_table() is None:
                raise StoreUnavailable("no seed answered")
            if not self.store.topology.complete():
                raise StoreUnavailable("some hash slots have no master")
            found: list[TenantTag] = []
            for node in self.store.topology.serving_nodes():
                for key in node.client.scan_iter(match=self._head + b"*", count=SCAN_COUNT):
                    suffix = bytes(key)[len(self._head):]
                    try:
                        found.append(TenantTag(bytes.fromhex(suffix.decode())))
                    except ValueError:  # not a record this version writes: left alone
                        continue
        except (StoreUnavailable, redis.RedisError, OSError) as e:
            raise FailedPrecondition(f"the shared store (T3) did not answer ({type(e).__name__}: {e}); "
                                     "nothing changed there") from None
        return list(dict.fromkeys(found))

    def fetch(self, tag: TenantTag) -> bytes | None:
        """The tenant's record (None: it has none); FailedPrecondition when its node did not answer."""
        key = self.record_key(tag)
        record = self._answered(key, "GET", key)
        return None if record is None else bytes(record)

    def replace(self, tag: TenantTag, expected: bytes, record: bytes) -> bool:
        """Store `record` if the tenant's record is still `expected` (one script on its node)."""
        key = self.record_key(tag)
        return bool(self._answered(key, "EVAL", _COMPARE_AND_SET, "1", key, expected, record))

    def _answered(self, key: bytes, *args: bytes | str):
        """The store's reply to one command (RedisStore.command); FailedPrecondition when its node did not answer."""
        try:
            return self.store.command(key, *args)
        except StoreUnavailable as e:
            raise FailedPrecondition(f"the shared store (T3) did not answer ({e})") from None

    def delete(self, tag: TenantTag) -> bool:
        key = self.record_key(tag)
        try:
            return bool(self.store.command(key, "DEL", key))
        except StoreUnavailable as e:
            raise FailedPrecondition(
                f"forget: the shared store (T3) did not answer ({e}), so the tenant's shared data key is not "
                "destroyed and nothing changed; forget again when the store answers") from None
