"""Configuration of the SSD tier: the daemon file's [ssd] section (SsdConfig, the node's T2) and
what one tier is opened with (SsdTierConfig, one layout's directory); the lock that keeps one tier
per directory, and the operator's description of a disk error."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import resource
from collections.abc import Mapping
from typing import TYPE_CHECKING

import lmdb

from kvtierd.config_checks import require_choice
from kvtierd.errors import InvalidArgument
from kvtierd.movers.codec_names import CODEC_NAMES
from kvtierd.t2.ssd_files import DISK_FULL_ERRNOS

if TYPE_CHECKING:
    from kvtierd.sealing.tenant_keys import TenantKeys
    from kvtierd.t2.node_budget import NodeBudget
from kvtierd.units import GiB

DURABILITY_POLICIES = ("fdatasync", "none")  # fdatasync: data synced before its index commit; none: neither synced
DEFAULT_SSD_CAPACITY_BYTES = 4 * GiB  # when not set: bounded by the slot files there plus half the free space


def default_ssd_dir(environ: Mapping[str, str] = os.environ) -> str:
    """$XDG_CACHE_HOME/kvtierd where that variable is an absolute path, else ~/.cache/kvtierd."""
    cache_home = environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(cache_home):
        cache_home = os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache_home, "kvtierd")


@dataclasses.dataclass(frozen=True, slots=True)
class SsdConfig:
    """[ssd]: the SSD tier (T2) of the node. Each layout's tier lives in `<directory>/<layout id>`
    (`tier_config`); `capacity_bytes` is the budget of all their slot files together."""

    directory: str = dataclasses.field(default_factory=default_ssd_dir)  # SSD tier (T2) files; "" disables T2
    capacity_bytes: int = DEFAULT_SSD_CAPACITY_BYTES  # bytes: SSD tier (T2) of the node, all layouts' files
    codec: str = "raw"  # "raw" | "fp8"
    durability: str = "fdatasync"  # "fdatasync" | "none"
    o_direct: bool = True  # bypass the page cache where the filesystem allows

    def __post_init__(self) -> None:
        require_choice("ssd.codec", self.codec, CODEC_NAMES)
        require_choice("ssd.durability", self.durability, DURABILITY_POLICIES)

    @property
    def enabled(self) -> bool:
        """T2 is on: a directory and a budget."""
        return bool(self.directory and self.capacity_bytes)

    def tier_config(self, layout_key: str, node_budget: NodeBudget | None = None,
                    tenant_keys: TenantKeys | None = None, max_age_s: float = 0.0) -> SsdTierConfig:
        """One layout's tier: its own directory under this one, the node's budget and data keys shared."""
        return SsdTierConfig([os.path.join(self.directory, layout_key)], self.capacity_bytes,
                             durability=self.durability, o_direct=self.o_direct, node_budget=node_budget,
                             tenant_keys=tenant_keys, max_age_s=max_age_s)


@dataclasses.dataclass(frozen=True, slots=True)
class SsdTierConfig:
    """What one tier opens: its directories and budget (the daemon's from SsdConfig.tier_config)."""

    directories: list[str]  # one slot file each; the LMDB index lives in the first
    capacity_bytes: int  # the most the slot files may grow to, over all directories, split evenly
    durability: str = "fdatasync"  # "fdatasync": data synced before its index commit; "none": neither synced
    o_direct: bool = True  # where the filesystem takes it
    num_io_threads: int = 4
    high_watermark: float = 0.95  # after a store, used bytes above high * capacity are evicted ...
    low_watermark: float = 0.85  # ... down to low * capacity, least recently used first
    lmdb_map_bytes: int = 1 << 30
    # The node's disk budget shared with other layouts' tiers: the files grow only by what it
    # grants. None: the tier's own budget of capacity_bytes.
    node_budget: NodeBudget | None = None
    # The node's tenant data keys: each block is sealed under its tenant's (encryption on). None: stored in the clear.
    tenant_keys: TenantKeys | None = None
    max_age_s: float = 0.0  # seconds since its store after which a block is a miss and reclaimed; 0 = no limit

    def __post_init__(self) -> None:
        if self.max_age_s < 0:
            raise InvalidArgument(f"max_age_s must be >= 0 seconds (0: no limit), got {self.max_age_s}")
        if not self.directories:
            raise InvalidArgument("ssd tier needs at least one directory")
        if self.capacity_bytes < 0 or self.lmdb_map_bytes <= 0 or self.num_io_threads < 1:
            raise InvalidArgument("capacity_bytes >= 0, lmdb_map_bytes > 0 and num_io_threads >= 1 required")
        if self.durability not in DURABILITY_POLICIES:
            raise InvalidArgument(f"durability must be one of {DURABILITY_POLICIES}, got {self.durability!r}")
        if not 0.0 < self.low_watermark <= self.high_watermark <= 1.0:
            raise InvalidArgument("watermarks must satisfy 0 < low <= high <= 1")


def describe_error(error: BaseException, where: str, path: str = "") -> str:
    """An operator's line: what failed and whether the disk is full."""
    text = str(error)
    if isinstance(error, lmdb.MapFullError):
        return f"index full (raise lmdb_map_bytes): {where} failed: {text}"
    if (isinstance(error, OSError) and error.errno in DISK_FULL_ERRNOS) or any(
            s in text for s in (os.strerror(errno.ENOSPC), os.strerror(errno.EDQUOT), os.strerror(errno.EFBIG))):
        return f"disk full: {where} failed: {text}"
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit != resource.RLIM_INFINITY:
        return f"disk I/O error (file size limit RLIMIT_FSIZE={limit} bytes?): {where} failed: {text}"
    with contextlib.suppress(OSError):
        if path and (st := os.statvfs(path)).f_bavail * st.f_frsize < (1 << 20):
            return f"disk full ({st.f_bavail * st.f_frsize} bytes free): {where} failed: {text}"
    return f"disk I/O error: {where} failed: {text}"
