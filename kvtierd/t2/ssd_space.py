"""What the SSD directory holds and has free: the layouts' slot files (the node's disk budget
counts them, a restarted daemon's included) and the default budget. No numpy, no torch: the
configuration and the start-up checks read it.
"""

from __future__ import annotations

import os

from kvtierd.units import ALIGNMENT_BYTES, MiB

SLOT_FILE_NAME = "kvtierd-slots.bin"
DEFAULT_FREE_FRACTION = 0.5  # of the free space, what a default SSD budget may add to the slot files there
MIN_DEFAULT_BUDGET_BYTES = 64 * MiB  # a default budget below this is none: 32 blocks of a Llama-3-8B layout


def layout_slot_files(directory: str) -> dict[str, int]:
    """`<directory>/<layout id>` → the size of its slot file, for every layout directory with one."""
    found = {}
    try:
        with os.scandir(directory) as entries:
            subdirectories = [entry.path for entry in entries if entry.is_dir(follow_symlinks=False)]
    except OSError:
        return {}
    for subdirectory in subdirectories:
        try:
            found[os.path.abspath(subdirectory)] = os.stat(os.path.join(subdirectory, SLOT_FILE_NAME)).st_size
        except OSError:
            pass
    return found


def slot_files_bytes(directory: str) -> int:
    """Bytes the slot files in `<directory>/*/` hold on disk."""
    total = 0
    for subdirectory in layout_slot_files(directory):
        try:
            total += os.stat(os.path.join(subdirectory, SLOT_FILE_NAME)).st_blocks * 512
        except OSError:
            pass
    return total


def free_bytes(path: str) -> int | None:
    """Free bytes (for an unprivileged user) of the filesystem `path`, or of its nearest existing
    ancestor; None when none can be read."""
    path = os.path.abspath(path)
    while not os.path.exists(path) and path != os.path.dirname(path):
        path = os.path.dirname(path)
    try:
        status = os.statvfs(path)
    except OSError:
        return None
    return status.f_bavail * status.f_frsize


def default_capacity_bytes(directory: str, default: int, fraction: float = DEFAULT_FREE_FRACTION) -> int:
    """The SSD budget when the operator set none: `default`, bounded by the slot files already in
    `directory` plus `fraction` of the free space (a restart keeps what it had); 0 (no room for
    T2) where that bound is below MIN_DEFAULT_BUDGET_BYTES."""
    free = free_bytes(directory)
    if free is None:
        return default
    bound = slot_files_bytes(directory) + int(free * fraction)
    budget = min(default, bound // ALIGNMENT_BYTES * ALIGNMENT_BYTES)
    return budget if budget >= MIN_DEFAULT_BUDGET_BYTES else 0
