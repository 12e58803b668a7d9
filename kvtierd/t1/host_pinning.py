"""Page-locking host memory for CUDA: who registers it, on which CPUs it is first touched.

A host tier of hundreds of GiB cannot be one cudaHostRegister (one of >= 512 GiB fails outright,
vLLM #51080) and takes tens of seconds to pin (an H200 machine: 8 GiB in 2.5 s by mmap + parallel
first touch + cudaHostRegister, cudaHostAlloc 4.7 s). So the slab (host_slab.py) is pinned in
grains of at most `GRAIN_BYTES` on slot boundaries, as its extent grows: each grain first touched by
several threads at once, bound to the CPUs of the GPU's NUMA node where the kernel says which
(first touch places a page on the toucher's node), then registered; a grain is unregistered when
the extent shrinks past it. Every registration is also entered in movers/pinned_regions.py, so that
no copy span straddles two of them.
"""

from __future__ import annotations

import concurrent.futures
import os
from pathlib import Path
from typing import Protocol

import torch

from kvtierd.units import GiB

GRAIN_BYTES = 1 * GiB  # at most this much per cudaHostRegister (a grain), whole slots
TOUCH_CHUNK_BYTES = 64 << 20  # what one touch thread faults in at a time


def grain_slots(stride: int, grain_bytes: int = GRAIN_BYTES) -> int:
    """Slots per grain: as many whole slots as `grain_bytes` holds, at least one."""
    return max(1, grain_bytes // stride)


class HostRegistrar(Protocol):
    """Page-locks host ranges for a device (CUDA: cudaHostRegister)."""

    def register(self, address: int, nbytes: int) -> None: ...

    def unregister(self, address: int) -> None: ...


class CudaHostRegistrar:
    """cudaHostRegister / cudaHostUnregister through torch's runtime binding."""

    def register(self, address: int, nbytes: int) -> None:
        cudart = torch.cuda.cudart()
        assert cudart is not None, "pinned only where CUDA is available"
        error = cudart.cudaHostRegister(address, nbytes, 0)
        if int(error) != 0:
            raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed with CUDA error {int(error)}")

    def unregister(self, address: int) -> None:
        cudart = torch.cuda.cudart()
        assert cudart is not None, "pinned only where CUDA is available"
        cudart.cudaHostUnregister(address)


def gpu_numa_cpus(device_index: int = 0) -> set[int] | None:
    """The CPUs of the NUMA node the GPU hangs off (from sysfs), or None where not known."""
    try:
        properties = torch.cuda.get_device_properties(device_index)
        bus = f"{properties.pci_domain_id:04x}:{properties.pci_bus_id:02x}:{properties.pci_device_id:02x}.0"
        node = int(Path(f"/sys/bus/pci/devices/{bus}/numa_node").read_text())
        if node < 0:
            return None
        return parse_cpu_list(Path(f"/sys/devices/system/node/node{node}/cpulist").read_text())
    except (AttributeError, OSError, RuntimeError, ValueError):
        return None


def parse_cpu_list(text: str) -> set[int]:
    """'0-3,8,10-11' -> {0, 1, 2, 3, 8, 10, 11} (the kernel's cpulist format)."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if part:
            low, _, high = part.partition("-")
            cpus.update(range(int(low), int(high or low) + 1))
    return cpus


def first_touch(memory: torch.Tensor, num_threads: int, cpus: set[int] | None) -> None:
    """Fault every page of `memory` in from several threads at once (torch's fill releases the GIL),
    each bound to `cpus` when given, so that the pages land on that NUMA node."""
    def touch(part: torch.Tensor) -> None:
        if cpus:
            os.sched_setaffinity(0, cpus)  # this thread only (0: the caller)
        part.zero_()

    with concurrent.futures.ThreadPoolExecutor(num_threads) as pool:
        list(pool.map(touch, memory.split(TOUCH_CHUNK_BYTES)))
