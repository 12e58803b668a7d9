"""The SSD free-room check: a restarted daemon's slot files count as room, since a layout
reuses its own file; a default budget without room is none, refused in a directory the operator
named, not in the default one."""

from __future__ import annotations

import os
import types

import pytest

from kvtierd.errors import FailedPrecondition
from kvtierd.server import ssd_state, startup_checks
from kvtierd.server.config_loader import load_config
from kvtierd.server.ssd_state import no_room_problem, off_by_choice
from kvtierd.t2 import ssd_space
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


@pytest.fixture
def little_free_room(monkeypatch):
    """Every SSD directory's filesystem has 100 MiB free: half of it is below a default budget's minimum."""
    for module in (ssd_space, ssd_state):
        monkeypatch.setattr(module, "free_bytes", lambda path: 100 * MiB)


def test_a_default_budget_below_its_minimum_is_no_budget(tmp_path, monkeypatch):
    """Not set: half the free space, none where that is below 64 MiB; given: as given."""
    environ = {"XDG_CACHE_HOME": str(tmp_path), "XDG_RUNTIME_DIR": str(tmp_path)}
    monkeypatch.setattr(ssd_space, "free_bytes", lambda path: 130 * MiB)
    assert load_config(environ=environ).ssd.capacity_bytes == 65 * MiB
    monkeypatch.setattr(ssd_space, "free_bytes", lambda path: 126 * MiB)
    assert load_config(environ=environ).ssd.capacity_bytes == 0
    assert load_config(environ={**environ, "KVTIERD_SSD_CAPACITY_BYTES": "1MiB"}).ssd.capacity_bytes == 1 * MiB


def test_the_loader_tells_a_choice_from_a_default(tmp_path):
    """given_keys: what the file, a variable or a flag set; `--ssd-bytes 0` is T2 off by choice, a
    default budget of 0 is not."""
    (tmp_path / "kvtierd.toml").write_text('[ssd]\ndirectory = "/srv/ssd"\n')
    config = load_config(str(tmp_path / "kvtierd.toml"), environ={"KVTIERD_POOL_T0_BYTES": "1MiB"},
                         overrides={"ssd.capacity_bytes": "0", "server.socket": None})
    assert config.given_keys == {"ssd.directory", "pool.t0_bytes", "ssd.capacity_bytes"}
    assert off_by_choice(config) and no_room_problem(config) == ""
    assert load_config(environ={}).given_keys == frozenset()


def test_a_named_directory_without_room_is_refused_the_default_one_runs_without_t2(tmp_path, little_free_room):
    named = load_config(environ={"XDG_CACHE_HOME": str(tmp_path)}, overrides={"ssd.directory": str(tmp_path / "ssd")})
    with pytest.raises(FailedPrecondition, match=rf"^--ssd-dir \(ssd.directory\): no room for T2 in {tmp_path}/ssd: "
                                                 r"its filesystem has 100.0 MiB free; .* at least 64.0 MiB"):
        startup_checks.check_machine(named)
    assert not (tmp_path / "ssd").exists()
    default = load_config(environ={"XDG_CACHE_HOME": str(tmp_path)})
    assert startup_checks.check_machine(default) is None
    assert no_room_problem(default).startswith(f"no room for T2 in {tmp_path}/kvtierd: its filesystem has 100.0 MiB")
