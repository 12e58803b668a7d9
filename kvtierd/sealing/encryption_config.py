"""The daemon file's [encryption] section: whether the lower tiers (T2, and T3 where configured)
keep blocks sealed per tenant, and where the node's master key is. No torch here."""

from __future__ import annotations

import dataclasses

from kvtierd.config_checks import require


@dataclasses.dataclass(frozen=True, slots=True)
class EncryptionConfig:
    enabled: bool = False  # seal every T2 and T3 value with its tenant's data key (AES-256-GCM)
    master_key_file: str = ""  # path of the node's master key: 32 random bytes, raw or as 64 hex digits; mode 0600

    def __post_init__(self) -> None:
        require(not self.enabled or self.master_key_file,
                "encryption.enabled needs encryption.master_key_file (a file of 32 random bytes, mode 0600)")
