"""The value of one block in the shared store: a versioned header, then the block's bytes.

Every read is verified before a byte reaches a tier: the store is shared by many nodes and
daemons of other versions, a value may have been overwritten by anything that can write the
key, and a short or failed read must be a miss, never KV (Dynamo #15079). A frame that does not
match what the reader asked for, in any field, is `FrameMismatch`; its reason is a counter label.

    offset  size  field
    0       4     magic b"KVT3"
    4       2     version (1), little-endian like every integer here
    6       2     length of the block hash H
    8       2     length of the parent hash P
    10      2     reserved (0)
    12      4     number of token ids N
    16      4     payload length L (the codec's slot bytes)
    20      16    layout digest: sha256(Layout.fingerprint() + codec name)[:16]
    36      8     xxh3-64 of everything from offset 44 to the end
    44      H     block hash (the daemon key: tenant tag + client hash)
    44+H    P     parent hash
    ...     4N    token ids, u32
    ...     L     the block in the codec's slot format

The checksum covers the hashes and token ids as well as the payload: the token ids read back are
committed beside the bytes in T0 when the caller did not send its own.
"""

from __future__ import annotations

import dataclasses
import hashlib
import struct

import xxhash

from kvtierd.daemon_key import DaemonKey
from kvtierd.layout import Layout
from kvtierd.token_bytes import TOKEN_ID_BYTES, TokenBytes, packed_size, token_count

MAGIC = b"KVT3"
VERSION = 1
_HEAD = struct.Struct("<4sHHHHII16sQ")
HEADER_BYTES = _HEAD.size  # 44


class FrameMismatch(Exception):
    """A value that is not the block asked for; `reason` names the check that failed."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason  # "short", "magic", "version", "layout", "hash", "parent", "tokens", "checksum"


def layout_digest(layout: Layout, codec_name: str) -> bytes:
    """16 bytes that differ for any two layouts or codecs: a frame of another one is a miss."""
    return hashlib.sha256(layout.fingerprint() + b"\0" + codec_name.encode()).digest()[:16]


class FrameValue:
    """One block's value as the pieces it is sent in: the header, hashes and token ids (a small
    bytes), then the payload as it was given (no copy); sealed (t3/sealed_values.py), no head and
    the sealed record. `block_hash`: the block's daemon key. `len()` is the value's length."""

    __slots__ = ("head", "payload", "block_hash", "nbytes")

    def __init__(self, head: bytes, payload: memoryview, block_hash: DaemonKey) -> None:
        self.head, self.payload, self.block_hash = head, payload, block_hash
        self.nbytes = len(head) + payload.nbytes

    def __len__(self) -> int:
        return self.nbytes

    def __bytes__(self) -> bytes:
        return self.head + bytes(self.payload)


def frame_value(digest: bytes, block_hash: DaemonKey, parent_hash: DaemonKey, token_ids: TokenBytes,
                payload) -> FrameValue:
    """One block's value: header, hashes, token ids (packed u32) and `payload` (a bytes-like, not
    copied: it must not change until the value is written)."""
    assert len(digest) == 16 and len(token_ids) % TOKEN_ID_BYTES == 0
    payload = memoryview(payload).cast("B")
    checksum = xxhash.xxh3_64()
    for part in (block_hash, parent_hash, token_ids, payload):
        checksum.update(part)
    head = _HEAD.pack(MAGIC, VERSION, len(block_hash), len(parent_hash), 0, token_count(token_ids), len(payload),
                      digest, checksum.intdigest())
    return FrameValue(b"".join((head, block_hash, parent_hash, token_ids)), payload, block_hash)


def frame_block(digest: bytes, block_hash: DaemonKey, parent_hash: DaemonKey, token_ids: TokenBytes, payload) -> bytes:
    """`frame_value` in one bytes (a copy of the payload)."""
    return bytes(frame_value(digest, block_hash, parent_hash, token_ids, payload))


@dataclasses.dataclass(frozen=True, slots=True)
class Frame:
    """A verified value: its parent, token ids and a view of its payload (into the value read)."""

    parent_hash: DaemonKey
    token_ids: TokenBytes
    payload: memoryview


def read_frame(value: bytes | memoryview | None, digest: bytes, block_hash: DaemonKey, parent_hash: DaemonKey | None,
               payload_nbytes: int, token_ids: TokenBytes | None = None, authenticated: bool = False) -> Frame:
    """Verify `value` as the block `block_hash` after `parent_hash` in the layout `digest`, with
    `payload_nbytes` of payload (and `parent_hash`, `token_ids`, when the caller knows them).
    `authenticated`: the frame was just opened from a sealed value (t3/sealed_values.py), whose GCM
    tag covers every byte of it under the tenant's key: the checksum is not computed again.
    Raises FrameMismatch."""
    if value is None or len(value) < HEADER_BYTES:
        raise FrameMismatch("short", f"{0 if value is None else len(value)} bytes")
    magic, version, hash_len, parent_len, reserved, num_tokens, length, frame_digest, checksum = \
        _HEAD.unpack_from(value)
    if magic != MAGIC:
        raise FrameMismatch("magic", repr(magic))
    if version != VERSION or reserved != 0:
        raise FrameMismatch("version", f"{version} (reserved {reserved})")
    if frame_digest != digest or length != payload_nbytes:
        raise FrameMismatch("layout", f"payload {length} bytes, expected {payload_nbytes}")
    view = memoryview(value)
    start = HEADER_BYTES
    tokens_at = start + hash_len + parent_len
    payload_at = tokens_at + packed_size(num_tokens)
    if len(value) != payload_at + length:
        raise FrameMismatch("short", f"{len(value)} bytes, the header says {payload_at + length}")
    if view[start:start + hash_len] != block_hash:
        raise FrameMismatch("hash")
    stored_parent = DaemonKey(bytes(view[start + hash_len:tokens_at]))
    if parent_hash is not None and stored_parent != parent_hash:
        raise FrameMismatch("parent")
    stored_tokens = TokenBytes(bytes(view[tokens_at:payload_at]))
    if token_ids is not None and stored_tokens != token_ids:
        raise FrameMismatch("tokens")
    if not authenticated and xxhash.xxh3_64_intdigest(view[start:]) != checksum:
        raise FrameMismatch("checksum")
    return Frame(stored_parent, stored_tokens, view[payload_at:])
