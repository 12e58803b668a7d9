"""Creating copy engines: CUDA streams for a CUDA pool, threads for a CPU one; one per device.

The factory sits above the interface (copy_engine.py) and its implementations, so neither
imports the other.
"""

from __future__ import annotations

import threading

from kvtierd.movers.copy_engine import CopyEngine, ThreadCopyEngine
from kvtierd.movers.cuda_copy_engine import CudaCopyEngine


def create_copy_engine(device: str = "cpu", num_cpu_threads: int = 2) -> CopyEngine:
    """ThreadCopyEngine for a CPU pool (of `num_cpu_threads` threads), CudaCopyEngine for a CUDA one."""
    if device.startswith("cuda"):
        return CudaCopyEngine(device)
    return ThreadCopyEngine(num_threads=num_cpu_threads)


class CopyEngines:
    """One copy engine per device, shared by the tiers of every layout on it (docs/architecture.md §6).

    A device's links have one byte budget and one bandwidth estimate whichever layout's blocks
    cross them, so two layouts on one GPU neither double the in-flight bytes nor learn two
    bandwidths. Reference-counted: `acquire` creates the device's engine or shares it, `release`
    closes it once its last user is done (a later `acquire` creates a fresh one).
    Invariant: `_engines[device]` is open and its count is the number of unreleased acquires.
    """

    def __init__(self, num_cpu_threads: int = 2) -> None:
        self.num_cpu_threads = num_cpu_threads  # of the engine of host memory (no CUDA)
        self._lock = threading.Lock()
        self._engines: dict[str, tuple[CopyEngine, int]] = {}  # device -> (engine, users); under _lock

    def acquire(self, device: str) -> CopyEngine:
        with self._lock:
            engine, num_users = self._engines.get(device, (None, 0))
            if engine is None:
                engine = create_copy_engine(device, self.num_cpu_threads)
            self._engines[device] = (engine, num_users + 1)
            return engine

    def release(self, engine: CopyEngine) -> None:
        """Drop one use; the last one closes the engine (waiting for its copies in flight)."""
        with self._lock:
            device = next((d for d, (e, _) in self._engines.items() if e is engine), None)
            assert device is not None, "release of an engine these CopyEngines did not hand out"
            _, num_users = self._engines[device]
            if num_users > 1:
                self._engines[device] = (engine, num_users - 1)
                return
            del self._engines[device]
        engine.close()

    def num_users(self, device: str) -> int:
        with self._lock:
            return self._engines.get(device, (None, 0))[1]
