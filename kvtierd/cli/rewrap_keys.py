"""`kvtierd rewrap-keys`: rotate the node's master key ([encryption]) by re-wrapping every tenant's
data key, with the daemon stopped; no block is touched (kvtierd/sealing/rotation.py)."""

from __future__ import annotations

import argparse
import os

from kvtierd.sealing.key_directory import KEY_DIRECTORY_NAME
from kvtierd.sealing.master_key import MasterKey
from kvtierd.sealing.rotation import rotate_master_key
from kvtierd.t2.directory_lock import DirectoryLock


def add_rewrap_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ssd-dir", required=True, help="the daemon's ssd.directory (its keys are in <dir>/keys)")
    parser.add_argument("--old-key-file", required=True, help="the master key file in use now")
    parser.add_argument("--new-key-file", required=True, help="the new master key file (32 random bytes or "
                                                              "64 hex digits, mode 0600)")


def run_rewrap_keys(args: argparse.Namespace) -> int:
    """Both key files checked as the daemon checks them; the SSD directory's lock held (a running
    daemon refuses the rotation); then every data key re-wrapped, or nothing changed."""
    old, new = MasterKey.load(args.old_key_file), MasterKey.load(args.new_key_file)
    lock = DirectoryLock.acquire(args.ssd_dir, "--ssd-dir")
    try:
        num_rewrapped = rotate_master_key(os.path.join(args.ssd_dir, KEY_DIRECTORY_NAME), old, new)
    finally:
        lock.release()
    print(f"re-wrapped {num_rewrapped} data key(s): master key {old.key_id} -> {new.key_id}; "
          f"start the daemon with encryption.master_key_file = {args.new_key_file}")
    return 0
