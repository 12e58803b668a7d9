"""`kvtierd rewrap-keys`: rotate the node's master key ([encryption]) by re-wrapping every tenant's
data key, with the daemon stopped; no block is touched (kvtierd/sealing/rotation.py). With
`--config` naming a daemon file with a [remote] store, the tenants' keys in the shared store too
(kvtierd/sealing/shared_rotation.py): once, from any one node of those sharing the store."""

from __future__ import annotations

import argparse
import os

from kvtierd.errors import InvalidArgument
from kvtierd.sealing.key_directory import KEY_DIRECTORY_NAME
from kvtierd.sealing.master_key import MasterKey
from kvtierd.sealing.rotation import rotate_master_key
from kvtierd.sealing.shared_rotation import SharedRewrap, rewrap_shared_keys
from kvtierd.server.config_loader import load_config
from kvtierd.t2.directory_lock import DirectoryLock
from kvtierd.t3.key_records import StoreKeyRecords
from kvtierd.t3.redis_store import RedisStore


def add_rewrap_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ssd-dir", required=True, help="the daemon's ssd.directory (its keys are in <dir>/keys)")
    parser.add_argument("--old-key-file", required=True, help="the master key file in use now")
    parser.add_argument("--new-key-file", required=True, help="the new master key file (32 random bytes or "
                                                              "64 hex digits, mode 0600)")
    parser.add_argument("--config", metavar="FILE",
                        help="the daemon's TOML file: with a [remote] store, re-wrap the tenants' keys there too "
                             "(once for every node that shares the store)")


def run_rewrap_keys(args: argparse.Namespace) -> int:
    """Both key files checked as the daemon checks them; the SSD directory's lock held (a running
    daemon refuses the rotation); then every data key re-wrapped, or nothing changed; then, with
    --config, the shared store's."""
    old, new = MasterKey.load(args.old_key_file), MasterKey.load(args.new_key_file)
    remote = None
    if args.config is not None:
        remote = load_config(args.config).remote  # as `kvtierd serve --config FILE` reads it
        if not remote.enabled:
            raise InvalidArgument(f"--config {args.config}: its [remote] section names no store "
                                  "(remote.endpoints), so there are no shared keys to re-wrap")
    lock = DirectoryLock.acquire(args.ssd_dir, "--ssd-dir")
    try:
        num_rewrapped = rotate_master_key(os.path.join(args.ssd_dir, KEY_DIRECTORY_NAME), old, new)
    finally:
        lock.release()
    print(f"re-wrapped {num_rewrapped} data key(s): master key {old.key_id} -> {new.key_id}; "
          f"start the daemon with encryption.master_key_file = {args.new_key_file}")
    if remote is not None:
        store = RedisStore(remote.with_password_read())
        try:
            shared = rewrap_shared_keys(StoreKeyRecords(store), old, new)
        finally:
            store.close()
        print(describe_shared(shared))
    return 0


def describe_shared(shared: SharedRewrap) -> str:
    line = (f"shared store: re-wrapped {shared.num_rewrapped} tenant key(s); {shared.num_already} already under "
            f"the new key")
    if shared.num_foreign:
        line += f"; {shared.num_foreign} opened by neither key (another master key's), left as they are"
    if shared.num_changed:
        line += f"; {shared.num_changed} changed meanwhile (a forget?), left: run it again"
    return line
