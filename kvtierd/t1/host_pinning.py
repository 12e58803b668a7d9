"""Page-locking the host slab in the background, chunk by chunk, so that T1 serves from its first
pinned chunk while the rest is still being pinned.

A slab of hundreds of GiB cannot be one cudaHostRegister (one of >= 512 GiB fails outright, vLLM
#51080) and takes tens of seconds to pin (an H200 machine: 8 GiB in 2.5 s by mmap + parallel first
touch + cudaHostRegister, cudaHostAlloc 4.7 s). So the slab is cut into chunks on slot boundaries,
the first of `FIRST_CHUNK_BYTES`, each next one twice the last, none above `MAX_REGISTRATION_BYTES`
(a 512 GiB slab: 14 registrations); each chunk is first touched by several threads at once, bound
to the CPUs of the GPU's NUMA node where the kernel says which (first touch places a page on the
toucher's node), then registered, then handed to the tier (`on_ready(num_ready_slots)`): T1's
usable slots grow as a prefix of the slab. A log line per chunk says how far it got.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

import torch

from kvtierd.movers import pinned_regions
from kvtierd.units import GiB

log = logging.getLogger(__name__)

FIRST_CHUNK_BYTES = 1 * GiB
MAX_REGISTRATION_BYTES = 64 * GiB
TOUCH_CHUNK_BYTES = 64 << 20  # what one touch thread faults in at a time


def registration_chunks(num_slots: int, stride: int, first_bytes: int = FIRST_CHUNK_BYTES,
                        max_bytes: int = MAX_REGISTRATION_BYTES) -> list[tuple[int, int]]:
    """Slot ranges [start, stop) covering the slab in order: the first of `first_bytes`, then doubling,
    none above `max_bytes`, each at least one slot (slot boundaries, so no slot straddles two)."""
    chunks, start, target = [], 0, first_bytes
    while start < num_slots:
        num = max(1, min(target, max_bytes) // stride)
        chunks.append((start, min(num_slots, start + num)))
        start, target = chunks[-1][1], target * 2
    return chunks


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


class SlabPinner:
    """Touches and registers the chunks of a slab on a thread of its own, in slot order.

    Invariants: the slots made ready are the prefix [0, num_ready_slots) and only grow; a chunk is
    handed over only once registered; every registered chunk is unregistered by `close` (which
    stops after the chunk in progress), so nothing stays page-locked after the slab goes.
    """

    def __init__(self, flat: torch.Tensor, stride: int, chunks: Sequence[tuple[int, int]],
                 registrar: HostRegistrar, on_ready: Callable[[int], None], num_touch_threads: int = 4,
                 cpus: set[int] | None = None, what: str = "host tier") -> None:
        self.flat, self.stride, self.chunks = flat, stride, list(chunks)
        self.registrar, self.on_ready = registrar, on_ready
        self.num_touch_threads, self.cpus, self.what = num_touch_threads, cpus, what
        self.num_ready_slots = 0
        self.seconds = 0.0  # from start to the last chunk registered
        self.error: BaseException | None = None
        self._registered: list[tuple[int, int]] = []  # (address, nbytes)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvtierd-pin", daemon=True)

    @property
    def pinned_bytes(self) -> int:
        return self.num_ready_slots * self.stride

    def start(self) -> None:
        self._thread.start()

    @property
    def started(self) -> bool:
        return self._thread.ident is not None

    def wait(self, timeout_s: float | None = None) -> bool:
        """Until every chunk is pinned (or pinning stopped; at once if never started); False on timeout."""
        if self.started:
            self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _run(self) -> None:
        started = time.perf_counter()
        total_bytes = (self.chunks[-1][1] * self.stride) if self.chunks else 0
        try:
            for start_slot, stop_slot in self.chunks:
                if self._stop.is_set():
                    return
                chunk = self.flat[start_slot * self.stride:stop_slot * self.stride]
                _first_touch(chunk, self.num_touch_threads, self.cpus)
                address, nbytes = chunk.data_ptr(), chunk.numel()
                self.registrar.register(address, nbytes)
                self._registered.append((address, nbytes))
                pinned_regions.add(address, nbytes)
                self.num_ready_slots = stop_slot
                self.seconds = time.perf_counter() - started
                self.on_ready(stop_slot)
                log.info("%s: %.1f of %.1f GiB page-locked (%.1f s)", self.what, self.pinned_bytes / GiB,
                         total_bytes / GiB, self.seconds)
        except BaseException as e:  # T1 keeps what is pinned; the rest of the slab is never used
            self.error = e
            log.error("%s: pinning stopped at %.1f GiB: %s", self.what, self.pinned_bytes / GiB, e)

    def close(self) -> None:
        """Stop after the chunk in progress, then unregister every chunk registered."""
        self._stop.set()
        self.wait()
        for address, nbytes in reversed(self._registered):
            pinned_regions.remove(address, nbytes)
            self.registrar.unregister(address)
        self._registered.clear()


def _first_touch(chunk: torch.Tensor, num_threads: int, cpus: set[int] | None) -> None:
    """Fault every page in from several threads at once (torch's fill releases the GIL), each bound
    to `cpus` when given, so that the pages land on that NUMA node."""
    def touch(part: torch.Tensor) -> None:
        if cpus:
            os.sched_setaffinity(0, cpus)  # this thread only (0: the caller)
        part.zero_()

    with concurrent.futures.ThreadPoolExecutor(num_threads) as pool:
        list(pool.map(touch, chunk.split(TOUCH_CHUNK_BYTES)))
