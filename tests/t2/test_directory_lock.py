"""One daemon per directory: a second lock is refused naming the holder's pid and changes
nothing; a released lock can be taken again."""

from __future__ import annotations

import os

import pytest

from kvtierd.errors import FailedPrecondition
from kvtierd.t2.directory_lock import LOCK_FILE_NAME, DirectoryLock


def test_a_second_lock_names_the_holder_and_changes_nothing(tmp_path):
    directory = tmp_path / "made" / "ssd"
    held = DirectoryLock.acquire(str(directory), "--ssd-dir (ssd.directory)")  # flock: per open file, so
    try:                                                                        # one process can be refused
        before = (directory / LOCK_FILE_NAME).stat()
        with pytest.raises(FailedPrecondition, match=rf"^--ssd-dir \(ssd.directory\): .* \(pid {os.getpid()}\)"):
            DirectoryLock.acquire(str(directory), "--ssd-dir (ssd.directory)")
        after = (directory / LOCK_FILE_NAME).stat()
        assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
        assert (directory / LOCK_FILE_NAME).read_text() == f"{os.getpid()}\n"
    finally:
        held.release()
    assert (directory / LOCK_FILE_NAME).read_text() == ""
    DirectoryLock.acquire(str(directory), "--ssd-dir (ssd.directory)").release()


def test_a_directory_that_cannot_be_created_is_refused_naming_the_setting(tmp_path):
    (tmp_path / "afile").write_text("")
    with pytest.raises(FailedPrecondition, match=r"^--ssd-dir \(ssd.directory\): cannot create"):
        DirectoryLock.acquire(str(tmp_path / "afile" / "ssd"), "--ssd-dir (ssd.directory)")
