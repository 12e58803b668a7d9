"""The master key file: refused at start when others may read it or it holds no key; never shown."""

from __future__ import annotations

import os

import pytest

from kvtierd.errors import InvalidArgument
from kvtierd.sealing.master_key import MasterKey

KEY = bytes(range(32))


def key_file(tmp_path, content: bytes, mode: int = 0o600) -> str:
    path = str(tmp_path / "master.key")
    with open(path, "wb") as f:
        f.write(content)
    os.chmod(path, mode)
    return path


@pytest.mark.parametrize("content", [KEY, KEY.hex().encode(), KEY.hex().encode() + b"\n",
                                     b"  " + KEY.hex().upper().encode()])
def test_a_key_is_read_raw_or_as_hex(tmp_path, content):
    """32 raw bytes and 64 hex digits (any case, whitespace around) are the same key."""
    master = MasterKey.load(key_file(tmp_path, content))
    assert master.key_bytes == KEY
    assert master.key_id == MasterKey(KEY).key_id != MasterKey(bytes(32)).key_id


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o700, 0o660])
def test_a_key_file_others_may_read_is_refused(tmp_path, mode):
    """Any bit beyond 0600 (group, others, execute) refuses the key, naming the mode, not the key."""
    with pytest.raises(InvalidArgument, match=f"mode {mode:04o}") as refused:
        MasterKey.load(key_file(tmp_path, KEY.hex().encode(), mode))
    assert KEY.hex() not in str(refused.value) and "\n" not in str(refused.value)


def test_mode_0400_is_taken(tmp_path):
    """Read-only for its owner, as a Kubernetes Secret mounts it, is allowed."""
    assert MasterKey.load(key_file(tmp_path, KEY, 0o400)).key_bytes == KEY


@pytest.mark.parametrize("content", [b"", KEY[:31], KEY + b"x" * 2, b"z" * 64, KEY.hex().encode()[:-1]])
def test_a_malformed_key_is_refused(tmp_path, content):
    """Another length, or 64 characters that are not hex, is no key: one line, the content not echoed."""
    with pytest.raises(InvalidArgument, match="is not a key") as refused:
        MasterKey.load(key_file(tmp_path, content))
    assert "\n" not in str(refused.value)


def test_a_missing_key_file_is_refused(tmp_path):
    with pytest.raises(InvalidArgument, match="No such file"):
        MasterKey.load(str(tmp_path / "absent.key"))


def test_repr_shows_the_id_not_the_key():
    master = MasterKey(KEY)
    assert master.key_id in repr(master) and KEY.hex() not in repr(master)
