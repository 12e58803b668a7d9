"""Wrapped data keys in a directory beside the T2 data: `<ssd.directory>/keys/<tenant tag hex>.key`,
one file per tenant, and `master-key-id`, the id of the master key that wrapped them.

Writes are atomic (a temporary file, fsync, rename, fsync of the directory); a delete is durable
when it returns (unlink, fsync of the directory), so a forgotten key stays forgotten through a
crash. The directory is mode 0700, the files 0600.

A daemon whose master key is not the one recorded refuses to start (`KeyDirectory.open` raises
FailedPrecondition): with another key every data key, and so every sealed block, would be
unreadable, which is better said at start than found out block by block.
"""

from __future__ import annotations

import contextlib
import os

from kvtierd.daemon_key import TAG_BYTES, TenantTag
from kvtierd.durable_files import replace_synced, sync_directory
from kvtierd.errors import FailedPrecondition
from kvtierd.sealing.master_key import MasterKey

KEY_DIRECTORY_NAME = "keys"
MASTER_ID_FILE = "master-key-id"
KEY_SUFFIX = ".key"


class KeyDirectory:
    """A WrappedKeyStore (tenant_keys.py) in one directory. Thread-safe: each call is one file operation."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    @classmethod
    def open(cls, directory: str, master: MasterKey) -> KeyDirectory:
        """The key directory, claimed for `master` (see `claim`)."""
        keys = cls(directory)
        keys.claim(master)
        return keys

    def claim(self, master: MasterKey) -> None:
        """Make the directory if missing and record `master` as the key that wraps its keys;
        FailedPrecondition, one line, if another master key wrapped them."""
        os.makedirs(self.directory, mode=0o700, exist_ok=True)
        recorded = self.recorded_master_id()
        if recorded is None:
            self.record_master(master)
        elif recorded != master.key_id:
            raise FailedPrecondition(
                f"encryption: the data keys in {self.directory} were wrapped by master key {recorded}, not by this "
                f"one ({master.key_id}); start with that key, rotate with `kvtierd rewrap-keys`, or remove the "
                "directory to start with an empty sealed cache")

    def recorded_master_id(self) -> str | None:
        """The id of the master key that wrapped the keys here; None before any was recorded."""
        try:
            with open(os.path.join(self.directory, MASTER_ID_FILE), encoding="ascii") as f:
                return f.read().strip()
        except FileNotFoundError:
            return None

    def read(self, tag: TenantTag) -> bytes | None:
        try:
            with open(self._path(tag), "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None

    def write(self, tag: TenantTag, wrapped: bytes) -> None:
        self._write_file(tag.hex() + KEY_SUFFIX, wrapped)

    def delete(self, tag: TenantTag) -> bool:
        try:
            os.unlink(self._path(tag))
        except FileNotFoundError:
            return False
        sync_directory(self.directory)
        return True

    def tags(self) -> list[TenantTag]:
        found = []
        for name in sorted(os.listdir(self.directory)):
            stem = name.removesuffix(KEY_SUFFIX)
            if name.endswith(KEY_SUFFIX) and len(stem) == 2 * TAG_BYTES:
                with contextlib.suppress(ValueError):
                    found.append(TenantTag(bytes.fromhex(stem)))
        return found

    def record_master(self, master: MasterKey) -> None:
        """After a rotation: the keys here are now wrapped by `master`."""
        self._write_file(MASTER_ID_FILE, master.key_id.encode("ascii"))

    def _path(self, tag: TenantTag) -> str:
        return os.path.join(self.directory, tag.hex() + KEY_SUFFIX)

    def _write_file(self, name: str, content: bytes) -> None:
        replace_synced(os.path.join(self.directory, name), content)
