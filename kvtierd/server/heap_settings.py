"""The daemon's C heap, set for blocks of megabytes: freed buffers are reused, not handed back.

Every Put and Get message, every value read from the shared store and every encoded response is a
buffer of about a block (2 MiB for Llama-3-8B), allocated and freed by the thousand a second.
glibc's malloc serves such sizes with fresh mmap'd pages or trims its heap back to the kernel
once more than a few MiB are free, so each new buffer's first write page-faults: measured here,
encoding 8 live 2 MiB responses ran at 1.5 GB/s against 25 GB/s once the heap keeps its pages
(`M_MMAP_THRESHOLD` 32 MiB, `M_TRIM_THRESHOLD` 256 MiB, through mallopt(3)).

The cost is resident memory: up to `TRIM_THRESHOLD_BYTES` of freed heap stays mapped. An operator
who set glibc's own variables (MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_, or the
GLIBC_TUNABLES malloc settings) keeps them: nothing is changed then. Elsewhere than glibc
(musl, macOS) nothing is changed either.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

log = logging.getLogger(__name__)

MMAP_THRESHOLD_BYTES = 32 << 20  # allocations below this come from the heap
TRIM_THRESHOLD_BYTES = 256 << 20  # free heap kept before any is handed back
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # <malloc.h>
_OPERATOR_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")


def keep_block_buffers_in_heap() -> bool:
    """Apply the thresholds above to this process's malloc; whether they were applied."""
    if any(name in os.environ for name in _OPERATOR_SETTINGS):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    applied = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1 and mallopt(
        _M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1
    log.debug("malloc thresholds for block buffers %s", "applied" if applied else "refused")
    return applied
