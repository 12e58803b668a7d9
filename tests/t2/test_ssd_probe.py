"""The SSD directory's start-up probe: it creates, writes, fsyncs and reads with O_DIRECT as the
tier would, refuses what the tier could not use, falls back where the tier falls back (O_DIRECT
refused with EINVAL), and leaves nothing behind either way."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvtierd.t2.ssd_probe import PROBE_FILE_PREFIX, UnusableDirectory, probe_directory

PROBE_SCRIPT = ("import dataclasses, json, sys\n"
                "from kvtierd.t2.ssd_probe import probe_directory\n"
                "print(json.dumps(dataclasses.asdict(probe_directory(sys.argv[1], True))))\n")


def everything_under(root) -> list[str]:
    return sorted(str(path.relative_to(root)) for path in root.rglob("*"))


def test_a_new_directory_is_probed_and_every_directory_it_made_removed_again(tmp_path):
    """Three missing levels: created, written, read back with O_DIRECT (this disk takes it), removed."""
    probe = probe_directory(str(tmp_path / "a" / "b" / "ssd"), o_direct=True)
    assert probe.o_direct_refused == "" and probe.free_bytes > 0
    assert everything_under(tmp_path) == []


def test_an_existing_directory_keeps_what_it_held_and_no_probe_file(tmp_path):
    (tmp_path / "layout").mkdir()
    (tmp_path / "layout" / "kvtierd-slots.bin").write_bytes(b"x" * 4096)
    probe_directory(str(tmp_path), o_direct=False)
    assert everything_under(tmp_path) == ["layout", "layout/kvtierd-slots.bin"]
    assert not any(name.startswith(PROBE_FILE_PREFIX) for name in os.listdir(tmp_path))


@pytest.mark.parametrize("where, reason", [
    (lambda tmp: tmp / "afile", "afile is not a directory"),
    (lambda tmp: tmp / "afile" / "sub", "its ancestor .*afile is not a directory"),
    (lambda tmp: "/proc/kvtierd-probe-test", "cannot create the directory /proc/kvtierd-probe-test: No such file"),
])
def test_a_directory_that_cannot_be_made_is_refused_naming_it(tmp_path, where, reason):
    (tmp_path / "afile").write_text("a file")
    with pytest.raises(UnusableDirectory, match=reason):
        probe_directory(str(where(tmp_path)), o_direct=True)
    assert everything_under(tmp_path) == ["afile"]


def test_a_directory_without_room_for_one_block_is_not_writable(tmp_path):
    """A full filesystem (a small tmpfs filled up, in a mount namespace of its own): the probe's
    write fails, and the reason names the disk."""
    done = subprocess.run(
        ["unshare", "--mount", "--map-root-user", "sh", "-c",
         'mount -t tmpfs -o size=64k kv "$0" && { cat /dev/zero > "$0/fill" 2>/dev/null; true; } && exec "$@"',
         str(tmp_path), sys.executable, "-c",
         "import sys\nfrom kvtierd.t2.ssd_probe import UnusableDirectory, probe_directory\n"
         "try:\n    probe_directory(sys.argv[1], True)\nexcept UnusableDirectory as e:\n    print(e)\n",
         str(tmp_path / "ssd")], capture_output=True, text=True, timeout=60)
    if done.returncode != 0 and "unshare" in done.stderr:
        pytest.skip(f"no mount namespace here: {done.stderr.strip()}")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"the directory {tmp_path / 'ssd'} is not writable: writing a file there failed: " \
                                  "No space left on device"


def test_a_filesystem_that_refuses_o_direct_falls_back_and_says_why(tmp_path):
    """ramfs refuses O_DIRECT at open (EINVAL): not a mistake, the tier uses buffered I/O there
    (ssd_files.py), so the probe passes and names the refusal; ramfs reports no free space."""
    done = subprocess.run(["unshare", "--mount", "--map-root-user", "sh", "-c",
                           'mount -t ramfs kv "$0" && exec "$@"', str(tmp_path), sys.executable, "-c", PROBE_SCRIPT,
                           str(tmp_path / "ssd")], capture_output=True, text=True, timeout=60)
    if done.returncode != 0 and "unshare" in done.stderr:
        pytest.skip(f"no mount namespace here: {done.stderr.strip()}")
    assert done.returncode == 0, done.stderr
    probe = json.loads(done.stdout)
    assert probe == {"free_bytes": 0, "o_direct_refused": "its filesystem refuses O_DIRECT at open (Invalid argument)"}
