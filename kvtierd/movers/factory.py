"""Creating copy engines: CUDA streams for a CUDA pool, threads for a CPU one.

The factory sits above the interface (copy_engine.py) and its implementations, so neither
imports the other.
"""

from __future__ import annotations

from kvtierd.movers.copy_engine import CopyEngine, ThreadCopyEngine
from kvtierd.movers.cuda_copy_engine import CudaCopyEngine


def create_copy_engine(device: str = "cpu", **kwargs) -> CopyEngine:
    """ThreadCopyEngine for a CPU pool, CudaCopyEngine for a CUDA one."""
    if device.startswith("cuda"):
        return CudaCopyEngine(device, **kwargs)
    return ThreadCopyEngine(**kwargs)
