"""The SSD free-room check: a restarted daemon's slot files count as room, since a layout
reuses its own file."""

from __future__ import annotations

import os
import types

import pytest

from kvtierd.errors import FailedPrecondition
from kvtierd.server import startup_checks
from kvtierd.t2.ssd_files import SLOT_FILE_NAME
from kvtierd.units import MiB


@pytest.fixture
def ssd_with_a_slot_file(tmp_path, monkeypatch):
    """An SSD directory holding one layout's 8 MiB slot file, on a filesystem with 4 MiB free."""
    layout_directory = tmp_path / "ssd" / "0123456789abcdef"
    layout_directory.mkdir(parents=True)
    with open(layout_directory / SLOT_FILE_NAME, "wb") as slot_file:
        os.posix_fallocate(slot_file.fileno(), 0, 8 * MiB)
    monkeypatch.setattr(startup_checks.os, "statvfs", lambda path: types.SimpleNamespace(f_bavail=1024, f_frsize=4096))
    return str(tmp_path / "ssd")


def test_earlier_slot_files_count_as_free_room(ssd_with_a_slot_file):
    startup_checks.check_ssd_directory(ssd_with_a_slot_file, 12 * MiB)


def test_beyond_free_room_and_slot_files_is_refused_naming_both(ssd_with_a_slot_file):
    with pytest.raises(FailedPrecondition, match=r"^--ssd-bytes \(ssd.capacity_bytes\): 13.0 MiB does not fit .*"
                                                 r"4.0 MiB free \(and 8.0 MiB in earlier slot files\)"):
        startup_checks.check_ssd_directory(ssd_with_a_slot_file, 13 * MiB)
