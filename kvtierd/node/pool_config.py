"""The daemon file's [pool] section: the device pool (T0) each layout gets, how many layouts the
node serves at once, and the hash of the block keys. No torch here."""

from __future__ import annotations

import dataclasses
import re

from kvtierd.block_hash import HASH_FUNCTIONS
from kvtierd.config_checks import require, require_choice
from kvtierd.units import MiB

CUDA_SHARES = ("fd", "ipc")


@dataclasses.dataclass(frozen=True, slots=True)
class PoolConfig:
    device: str = "auto"  # "auto" | "cpu" | "cuda" | "cuda:N"
    t0_bytes: int = 256 * MiB  # bytes: device pool (T0), per layout
    max_layouts: int = 4  # count: distinct layouts (pools) served at once
    hash_algo: str = "sha256"  # "sha256" | "xxh3_128"
    # how a CUDA pool reaches engines: "fd" (a cuMem allocation whose POSIX fd goes over the fd socket:
    # engines of another uid, no hostIPC) | "ipc" (a cudaIpc handle: same uid or hostIPC)
    cuda_share: str = "fd"

    def __post_init__(self) -> None:
        require(self.t0_bytes > 0, "pool.t0_bytes must be > 0")
        require(self.max_layouts >= 1, f"pool.max_layouts must be >= 1, got {self.max_layouts}")
        require(re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device),
                f"pool.device must be auto, cpu, cuda or cuda:N; got {self.device!r}")
        require_choice("pool.hash_algo", self.hash_algo, tuple(HASH_FUNCTIONS))
        require_choice("pool.cuda_share", self.cuda_share, CUDA_SHARES)
