"""A block's bytes sealed under its tenant's data key: what T2 writes when encryption is on.

Sealed record, `sealed_nbytes(n)` = n + SEAL_OVERHEAD_BYTES bytes:

    nonce (12, random per write) | ciphertext (n) | GCM tag (16)

AES-256-GCM with associated data that binds the block's place in the cache:

    DOMAIN | context digest (32: the tier's layout fingerprint and codec) | daemon key (tenant tag + block hash)

The block hash chains the whole prefix and its cache_salt, and the tag names the tenant, so a
record copied to another slot, key, tenant, layout or codec fails its tag: `open_into` answers
False and the caller counts a miss. A tenant without a data key (forgotten, or never stored)
opens nothing. Nothing here logs; plaintext and keys never leave the caller's buffers.

A block's token ids (the prompt itself: kept in the T2 index to verify hits) are sealed the same
way under a domain of their own (`seal_tokens`, `open_tokens`), so the index holds no prompt either.
"""

from __future__ import annotations

import hashlib
import os
from typing import Protocol

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from kvtierd.daemon_key import DaemonKey, TenantTag, tenant_tag_of
from kvtierd.sealing.tenant_keys import GCM_TAG_BYTES, NONCE_BYTES

SEAL_OVERHEAD_BYTES = NONCE_BYTES + GCM_TAG_BYTES
_DOMAIN = b"kvtierd-sealed-block-v1\x00"
_TOKENS_DOMAIN = b"kvtierd-sealed-tokens-v1\x00"


def sealed_nbytes(plain_nbytes: int) -> int:
    return plain_nbytes + SEAL_OVERHEAD_BYTES


class Keyring(Protocol):
    """Whose data key seals a tenant's records: TenantKeys (T2's, on this node) or the keys one T3
    batch resolved from the shared store (t3/sealed_values.py)."""

    def cipher_for_store(self, tag: TenantTag) -> AESGCM: ...

    def cipher_for_load(self, tag: TenantTag) -> AESGCM | None: ...


def seal_context(layout_fingerprint: bytes, codec: str, record_kind: str = "") -> bytes:
    """What a tier's records are bound to besides their key: its layout and codec (and, for a tier
    whose records are not bare blocks, what they are: T3's "frame"), as a 32-byte digest."""
    kind = b"\x00kind=" + record_kind.encode() if record_kind else b""
    return hashlib.sha256(layout_fingerprint + b"\x00codec=" + codec.encode() + kind).digest()


class BlockSealer:
    """Seals and opens one tier's blocks (one layout and codec). Thread-safe: no state of its own."""

    def __init__(self, keys: Keyring, context: bytes) -> None:
        self.keys = keys
        self._prefix = _DOMAIN + context
        self._tokens_prefix = _TOKENS_DOMAIN + context

    def seal_into(self, key: DaemonKey, plaintext: memoryview, out: memoryview) -> None:
        """Write the sealed record of `plaintext` into `out[:sealed_nbytes(len)]`."""
        n = plaintext.nbytes
        nonce = os.urandom(NONCE_BYTES)
        out[:NONCE_BYTES] = nonce
        cipher = self.keys.cipher_for_store(tenant_tag_of(key))
        cipher.encrypt_into(nonce, plaintext, self._prefix + key, out[NONCE_BYTES:NONCE_BYTES + n + GCM_TAG_BYTES])

    def open_into(self, key: DaemonKey, sealed: memoryview, out: memoryview) -> bool:
        """Authenticate `sealed` as `key`'s record and decrypt it into `out` (its plaintext length);
        False, `out` zeroed, when it is not (moved, altered, or its tenant's key is gone): GCM
        decrypts before it checks, so a failed open must not leave what it decrypted."""
        cipher = self.keys.cipher_for_load(tenant_tag_of(key))
        if cipher is None or sealed.nbytes != sealed_nbytes(out.nbytes):
            return False
        try:
            cipher.decrypt_into(sealed[:NONCE_BYTES], sealed[NONCE_BYTES:], self._prefix + key, out)
        except InvalidTag:
            out[:] = bytes(out.nbytes)
            return False
        return True

    def seal_tokens(self, key: DaemonKey, token_bytes: bytes) -> bytes:
        """The block's token ids sealed: nonce | ciphertext | tag."""
        nonce = os.urandom(NONCE_BYTES)
        cipher = self.keys.cipher_for_store(tenant_tag_of(key))
        return nonce + cipher.encrypt(nonce, token_bytes, self._tokens_prefix + key)

    def open_tokens(self, key: DaemonKey, sealed: bytes) -> bytes | None:
        """The token ids `seal_tokens` sealed for `key`; None when they do not open as its."""
        cipher = self.keys.cipher_for_load(tenant_tag_of(key))
        if cipher is None or len(sealed) < SEAL_OVERHEAD_BYTES:
            return None
        try:
            return cipher.decrypt(sealed[:NONCE_BYTES], sealed[NONCE_BYTES:], self._tokens_prefix + key)
        except InvalidTag:
            return None
