"""T3 values sealed per tenant ([encryption] on with a T3): what a RemoteTier writes instead of a
plain frame, and opens before it verifies the frame.

A sealed value is BlockSealer's record (sealing/block_seal.py) of the whole frame (block_frame.py:
header, hashes, token ids, payload), so the store holds neither a block's bytes nor its prompt:

    nonce (12, random per write) | the frame, encrypted | GCM tag (16)

AES-256-GCM under the tenant's shared data key (sealing/shared_tenant_keys.py), with associated
data DOMAIN | context digest (layout fingerprint, codec, "t3-frame") | daemon key (tenant tag +
block hash, which chains the whole prefix and its cache_salt). A value moved to another key,
tenant, layout or codec, altered, or sealed under a key the store no longer holds (its tenant
forgotten) does not open: a miss, counted as refused ("unauthentic"), never served.

The keys are the store's records as they are when the operation runs: a write batch reads its
tenants' records before it seals (`seal`, on the T3 writer's thread), a load GETs them beside its
blocks (`record_keys`, then `opener`). Sealing and opening run on the T3 writer's and readers'
threads (AES-GCM with AES-NI: ~15 GB/s a core here), never on the event loop.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from kvtierd.daemon_key import DaemonKey, TenantTag, tenant_tag_of
from kvtierd.sealing.block_seal import SEAL_OVERHEAD_BYTES, BlockSealer, seal_context, sealed_nbytes
from kvtierd.sealing.shared_tenant_keys import SharedTenantKeys
from kvtierd.t3.block_frame import FrameValue

RECORD_KIND = "t3-frame"  # what the sealed records hold, bound into their context digest


class ResolvedKeys:
    """A Keyring (block_seal.py) of the keys one operation took from the store's records: tag →
    cipher, None where the tenant has no key this node can use."""

    def __init__(self, ciphers: dict[TenantTag, AESGCM | None]) -> None:
        self.ciphers = ciphers

    def cipher_for_store(self, tag: TenantTag) -> AESGCM:
        cipher = self.ciphers.get(tag)
        assert cipher is not None, "sealed only where the tenant has a key"
        return cipher

    def cipher_for_load(self, tag: TenantTag) -> AESGCM | None:
        return self.ciphers.get(tag)


class ValueSealing:
    """One layout's T3 values sealed and opened (one layout and codec). Thread-safe: its state is
    the keyring's."""

    def __init__(self, keys: SharedTenantKeys, layout_fingerprint: bytes, codec: str) -> None:
        self.keys = keys
        self.records = keys.records
        self.context = seal_context(layout_fingerprint, codec, RECORD_KIND)

    def record_keys(self, tags: Sequence[TenantTag]) -> list[bytes]:
        """The store keys of the tenants' key records (for a GET or EXISTS beside their blocks')."""
        return [self.records.record_key(tag) for tag in tags]

    def opener(self, tags: Sequence[TenantTag], records: Sequence[memoryview | bytes | None]) -> BlockSealer:
        """A sealer that opens values of `tags` with the keys of `records`, as the store gave them."""
        return BlockSealer(ResolvedKeys({tag: self.keys.cipher_of(tag, bytes(r) if r is not None else None)
                                         for tag, r in zip(tags, records)}), self.context)

    def open(self, opener: BlockSealer, block_hash: DaemonKey, value: memoryview) -> memoryview | None:
        """The frame sealed in `value`, as `block_hash`'s (a new buffer); None when it does not open."""
        if value.nbytes < SEAL_OVERHEAD_BYTES:
            return None
        frame = np.empty(value.nbytes - SEAL_OVERHEAD_BYTES, np.uint8).data
        return frame if opener.open_into(block_hash, value, frame) else None

    def seal(self, items: Sequence[tuple[bytes, FrameValue]]) -> list[FrameValue | None]:
        """Each (store key, frame) sealed under its tenant's key as the store holds it now (made
        there when the tenant has none); None where there is no key this node can use (the store
        did not answer, or another master key wrapped it): not written. Blocking: reads the
        records, may write one."""
        tags = list(dict.fromkeys(tenant_tag_of(frame.block_hash) for _, frame in items))
        keys = ResolvedKeys({tag: self.keys.cipher_to_seal(tag, record)
                             for tag, record in zip(tags, self.records.read(tags))})
        sealer = BlockSealer(keys, self.context)
        return [_sealed(sealer, frame) if keys.cipher_for_load(tenant_tag_of(frame.block_hash)) is not None else None
                for _, frame in items]


def _sealed(sealer: BlockSealer, frame: FrameValue) -> FrameValue:
    """`frame` as one sealed record: its pieces joined (a copy) and sealed into a buffer of its own."""
    plain = np.empty(frame.nbytes, np.uint8)
    head_nbytes = len(frame.head)
    plain[:head_nbytes] = np.frombuffer(frame.head, np.uint8)
    plain[head_nbytes:] = np.frombuffer(frame.payload, np.uint8)
    sealed = np.empty(sealed_nbytes(frame.nbytes), np.uint8).data
    sealer.seal_into(frame.block_hash, plain.data, sealed)
    return FrameValue(b"", sealed, frame.block_hash)
