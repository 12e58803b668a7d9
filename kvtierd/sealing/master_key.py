"""The node's master key: it wraps every tenant's data key (tenant_keys.py) and seals nothing else.

The file holds 32 random bytes, raw or as 64 hexadecimal digits (`openssl rand -hex 32`), and
must be readable by its owner alone (mode 0600 or 0400): a wider mode, a missing file or another
length refuses the daemon's start with one line that names the file, never its content.
`key_id` is a one-way digest of the key (not the key): the data keys' directory records it, so
that a daemon started with another master key is refused instead of finding every key unreadable.
"""

from __future__ import annotations

import hashlib
import os
import stat

from kvtierd.errors import InvalidArgument

MASTER_KEY_BYTES = 32  # AES-256
_ID_DOMAIN = b"kvtierd-master-key-id\x00"
ALLOWED_MODE_BITS = stat.S_IRUSR | stat.S_IWUSR  # 0600: owner read and write, nobody else


class MasterKey:
    """32 bytes and their id. `__repr__` shows the id only: the key never reaches a log."""

    __slots__ = ("key_bytes", "key_id")

    def __init__(self, key_bytes: bytes) -> None:
        assert len(key_bytes) == MASTER_KEY_BYTES
        self.key_bytes = key_bytes
        self.key_id = hashlib.sha256(_ID_DOMAIN + key_bytes).hexdigest()[:16]

    def __repr__(self) -> str:
        return f"MasterKey(id={self.key_id})"

    @classmethod
    def load(cls, path: str) -> MasterKey:
        """Read and check the key file; InvalidArgument with one line on any fault."""
        try:
            with open(path, "rb") as f:
                mode = os.fstat(f.fileno()).st_mode
                content = f.read(4 * MASTER_KEY_BYTES)
        except OSError as error:
            raise InvalidArgument(f"encryption.master_key_file {path}: {error.strerror}") from None
        if stat.S_IMODE(mode) & ~ALLOWED_MODE_BITS:
            raise InvalidArgument(f"encryption.master_key_file {path} has mode {stat.S_IMODE(mode):04o}: "
                                  "readable by others than its owner; chmod 600 it")
        return cls(parse_key(content, path))


def parse_key(content: bytes, path: str) -> bytes:
    """The key in a file's content: 32 raw bytes, or 64 hex digits and optional surrounding whitespace."""
    if len(content) == MASTER_KEY_BYTES:
        return content
    text = content.strip()
    if len(text) == 2 * MASTER_KEY_BYTES:
        try:
            return bytes.fromhex(text.decode("ascii"))
        except (UnicodeDecodeError, ValueError):
            pass
    raise InvalidArgument(f"encryption.master_key_file {path} is not a key: expected {MASTER_KEY_BYTES} raw bytes "
                          f"or {2 * MASTER_KEY_BYTES} hex digits (openssl rand -hex 32)")
