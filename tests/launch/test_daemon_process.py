"""DaemonProcess reports a child that dies before "ready" as it died, and Python children
cannot be shadowed by the working directory."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvtierd.launch.daemon_process import DaemonProcess, DaemonStartError, python_module_command, small_daemon_args


def test_a_child_that_exits_before_ready_is_reported_with_its_status_and_output(tmp_path):
    with pytest.raises(DaemonStartError) as raised:
        DaemonProcess(small_daemon_args(str(tmp_path), extra=["--set", "no_such_section.key=1"]))
    message = str(raised.value)
    assert message.startswith("kvtierd serve exited with status 2 before it was ready:")
    assert "no_such_section" in message  # the child's own error line


def test_a_child_that_stays_silent_is_reported_after_the_timeout_and_killed(tmp_path, monkeypatch):
    silent = [sys.executable, "-c", "import time; time.sleep(600)"]
    monkeypatch.setattr("kvtierd.launch.daemon_process.python_module_command", lambda *args: silent)
    with pytest.raises(DaemonStartError, match="did not become ready within 1 s"):
        DaemonProcess([], ready_timeout_s=1.0)


def test_python_children_keep_the_working_directory_off_sys_path(tmp_path):
    """A directory named kvtierd in the working directory is not what the child imports."""
    (tmp_path / "kvtierd").mkdir()
    (tmp_path / "kvtierd" / "__init__.py").write_text("raise ImportError('the working directory shadowed kvtierd')\n")
    done = subprocess.run([*python_module_command("kvtierd.cli.kvtierd_main", "--version")], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("kvtierd ")

