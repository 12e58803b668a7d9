"""The node's tenant data keys, from the daemon file's [encryption] section.

With `encryption.enabled` the master key is read and checked when the daemon is built (a key file
others may read, or one that holds no key, refuses the start in one line), and the data keys live
in `<ssd.directory>/keys`, claimed for that master key once the SSD directory is locked (a
directory whose keys another master key wrapped refuses the start: key_directory.py). Encryption
seals T2's values, so it needs T2. With a T3 the same master key wraps the tenants' T3 data keys,
kept in the shared store (sealing/shared_tenant_keys.py; the pool registry builds that keyring
with the store's client), and T3's values are sealed under them.
"""

from __future__ import annotations

import dataclasses
import os

from kvtierd.errors import InvalidArgument
from kvtierd.sealing.key_directory import KEY_DIRECTORY_NAME, KeyDirectory
from kvtierd.sealing.master_key import MasterKey
from kvtierd.sealing.tenant_keys import TenantKeys
from kvtierd.server.daemon_config import DaemonConfig


@dataclasses.dataclass(frozen=True, slots=True)
class NodeKeys:
    """The master key, the directory of wrapped data keys, and the keyring the pools seal with."""

    master: MasterKey
    directory: KeyDirectory
    tenant_keys: TenantKeys

    def claim(self) -> None:
        """Record (or check) the master key in the key directory: after the SSD directory's lock."""
        self.directory.claim(self.master)

    def describe(self, with_t3: bool = False) -> str:
        t3 = "; T3 values sealed per tenant, their data keys wrapped in the shared store" if with_t3 else ""
        return (f"T2 values sealed per tenant (AES-256-GCM), data keys in {self.directory.directory} "
                f"wrapped by master key {self.master.key_id}{t3}")


def node_keys(config: DaemonConfig) -> NodeKeys | None:
    """The node's keys where encryption is on (None otherwise); InvalidArgument for a bad setup."""
    encryption = config.encryption
    if not encryption.enabled:
        return None
    if not config.ssd.enabled:
        raise InvalidArgument("encryption.enabled seals the SSD tier's values and keeps the data keys beside them: "
                              "it needs T2 (ssd.directory and ssd.capacity_bytes)")
    master = MasterKey.load(encryption.master_key_file)
    directory = KeyDirectory(os.path.join(config.ssd.directory, KEY_DIRECTORY_NAME))
    return NodeKeys(master, directory, TenantKeys(master, directory))
