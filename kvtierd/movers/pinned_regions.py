"""The host ranges this process registered with CUDA, so that no copy span straddles two of them.

The host tier pins its slab in several cudaHostRegister calls (one of 512 GiB or more fails
outright, vLLM #51080; t1/host_pinning.py registers at most 64 GiB at a time). The driver treats a
copy whose host range is not inside one registration as pageable memory (staged, slow), so a run
of slots that span_copy.py coalesced across a registration boundary is split there before it is
submitted. Thread-safe; the registrations are few (one per chunk of a slab).
"""

from __future__ import annotations

import bisect
import threading

import numpy as np

_lock = threading.Lock()
_boundaries: list[int] = []  # sorted start and end addresses of the registered ranges (under _lock)


def add(address: int, nbytes: int) -> None:
    """A range [address, address + nbytes) was registered."""
    with _lock:
        for point in (address, address + nbytes):
            bisect.insort(_boundaries, point)


def remove(address: int, nbytes: int) -> None:
    """The range registered by `add(address, nbytes)` was unregistered."""
    with _lock:
        for point in (address, address + nbytes):
            _boundaries.remove(point)


def split_spans(host_addresses: np.ndarray, other_addresses: np.ndarray,
                sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The spans cut wherever a host range crosses a registration boundary (both sides' addresses
    advance together); the same arrays when none does (the usual case: one vectorized check)."""
    with _lock:
        boundaries = np.unique(np.asarray(_boundaries, dtype=np.uint64))  # adjacent ranges share a point
    if not len(boundaries) or not len(sizes):
        return host_addresses, other_addresses, sizes
    ends = host_addresses + sizes
    first_after = np.searchsorted(boundaries, host_addresses, side="right")
    candidates = boundaries[np.minimum(first_after, len(boundaries) - 1)]
    crossing = (first_after < len(boundaries)) & (candidates < ends)
    if not crossing.any():
        return host_addresses, other_addresses, sizes
    hosts, others, lengths = [], [], []
    for host, other, size, crosses in zip(host_addresses.tolist(), other_addresses.tolist(), sizes.tolist(),
                                          crossing.tolist()):
        cuts = [int(b) for b in boundaries if host < b < host + size] if crosses else []
        start = host
        for cut in [*cuts, host + size]:
            hosts.append(start)
            others.append(other + (start - host))
            lengths.append(cut - start)
            start = cut
    return (np.asarray(hosts, dtype=np.uint64), np.asarray(others, dtype=np.uint64),
            np.asarray(lengths, dtype=np.uint64))
