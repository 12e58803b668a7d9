"""Master-key rotation: every data key re-wrapped by the new master key; no block is read or written
(the blocks are sealed under the data keys, which do not change).

Run with the daemon stopped (`kvtierd rewrap-keys` holds the SSD directory's lock). The new wrapped
keys are written to `<keys>.rewrap` first, with the new key's id; only when every key re-wrapped is
the directory swapped in: `keys` → `keys.previous`, `keys.rewrap` → `keys`, then `keys.previous`
removed. A crash before the swap leaves the old directory in force (run it again); a crash between
the two renames leaves no `keys` and both others: `rotate_master_key` run again finishes the swap
(a daemon started meanwhile would find no keys, so every sealed block would be a miss, never served
in the clear: run the rotation again before starting it).
"""

from __future__ import annotations

import os
import shutil

from kvtierd.durable_files import sync_directory
from kvtierd.errors import FailedPrecondition
from kvtierd.sealing.key_directory import KeyDirectory
from kvtierd.sealing.master_key import MasterKey
from kvtierd.sealing.tenant_keys import rewrap_all

STAGING_SUFFIX = ".rewrap"
PREVIOUS_SUFFIX = ".previous"


def rotate_master_key(directory: str, old: MasterKey, new: MasterKey) -> int:
    """Re-wrap every data key in `directory` from `old` to `new`; returns how many. Nothing changes
    (FailedPrecondition) when the keys are not `old`'s or one of them does not unwrap with it."""
    staging, previous = directory + STAGING_SUFFIX, directory + PREVIOUS_SUFFIX
    if not os.path.isdir(directory) and os.path.isdir(staging) and os.path.isdir(previous):
        _swap_in(directory, staging, previous)  # an interrupted rotation, finished
    keys = KeyDirectory(directory)
    recorded = keys.recorded_master_id()
    if recorded == new.key_id:
        return 0
    if recorded != old.key_id:
        raise FailedPrecondition(f"the data keys in {directory} were wrapped by master key {recorded}, "
                                 f"not by the old key given ({old.key_id}); nothing changed")
    shutil.rmtree(staging, ignore_errors=True)
    staged = KeyDirectory.open(staging, new)
    num_rewrapped, failed = rewrap_all(keys, staged, old, new)
    if failed:
        shutil.rmtree(staging)
        raise FailedPrecondition(f"{len(failed)} data key(s) in {directory} do not unwrap with the old key "
                                 f"(damaged files?); nothing changed")
    _swap_in(directory, staging, previous)
    return num_rewrapped


def _swap_in(directory: str, staging: str, previous: str) -> None:
    if os.path.isdir(directory):
        os.rename(directory, previous)
    os.rename(staging, directory)
    sync_directory(os.path.dirname(directory) or ".")
    shutil.rmtree(previous, ignore_errors=True)
