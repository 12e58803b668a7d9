"""`kvtierd` and `kvtierctl` as Unix tools, run as the real commands: a closed pipe ends them quietly
with exit 0, `--version` answers, a subcommand's unknown argument is reported under that
subcommand's usage, a demo flag that does not apply is refused before anything loads, and a count
of one reads as one."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import time

import pytest

from kvtierd.client import KvtierClient
from kvtierd.launch.daemon_process import DaemonProcess, python_module_command, small_daemon_args
from tests.server.e2e_runner import LAYOUT

KVTIERCTL = python_module_command("kvtierd.cli.kvtierctl")
KVTIERD = python_module_command("kvtierd.cli.kvtierd_main")
SMALL_SIMULATION = ("simulate", "--conversations", "3", "--turns", "2", "--system-prompt-tokens", "64",
                    "--pool-blocks", "64")


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    with DaemonProcess(small_daemon_args(str(tmp_path_factory.mktemp("unix-tool")))) as process:
        yield process


def run(command: list[str], timeout_s: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)


def run_into_closed_pipe(command: list[str], timeout_s: float = 60) -> subprocess.CompletedProcess:
    """`command` with stdout a pipe whose read end is closed before it starts: its first write, or
    its final flush, finds the reader gone (as `| head -0` would, with no race)."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run(command, stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=timeout_s)
    finally:
        os.close(write_end)


# ----------------------------------------------------------------------------- a closed pipe


@pytest.mark.parametrize("args", [("stats",), ("stats", "--json")], ids=["table", "json"])
def test_kvtierctl_into_a_closed_pipe_ends_quietly_with_0(daemon, args):
    """`kvtierctl stats | head -1`: exit 0 and nothing on stderr, not a BrokenPipeError traceback."""
    done = run_into_closed_pipe([*KVTIERCTL, "--address", daemon.address, *args])
    assert (done.returncode, done.stderr) == (0, "")


@pytest.mark.parametrize("args", [SMALL_SIMULATION, (*SMALL_SIMULATION, "--json")], ids=["table", "json"])
def test_kvtierd_into_a_closed_pipe_ends_quietly_with_0(args):
    """`kvtierd simulate | head -1`: exit 0 and nothing on stderr."""
    done = run_into_closed_pipe([*KVTIERD, *args])
    assert (done.returncode, done.stderr) == (0, "")


def test_watch_stops_as_soon_as_its_reader_goes(daemon):
    """`kvtierctl stats --watch 600 | head -1` ends when head does, not at the next refresh 600 s later."""
    process = subprocess.Popen([*KVTIERCTL, "--address", daemon.address, "stats", "--watch", "600"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = process.stdout.readline()
        process.stdout.close()
        returncode = process.wait(timeout=30)  # only the closed pipe can end it this soon
        stderr = process.stderr.read()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        process.stderr.close()
    assert first.startswith("kvtierd ")
    assert (returncode, stderr) == (0, "")


# ----------------------------------------------------------------------------- --version


def test_both_commands_print_the_package_version():
    """`kvtierctl --version`, `kvtierd --version`: the installed package's version, exit 0, no daemon."""
    version = importlib.metadata.version("kvtierd")
    for command, name in ((KVTIERCTL, "kvtierctl"), (KVTIERD, "kvtierd")):
        done = run([*command, "--version"])
        assert (done.returncode, done.stdout, done.stderr) == (0, f"{name} {version}\n", ""), name


# ----------------------------------------------------------------------------- unknown arguments


@pytest.mark.parametrize("subcommand", ["serve", "simulate", "fetch-model", "demo"])
def test_kvtierd_reports_a_subcommands_unknown_argument_under_its_usage(subcommand):
    """`kvtierd serve --bogus`: serve's usage and `kvtierd serve: error: ...`, exit 2; an unknown
    argument before the subcommand stays the top level's."""
    done = run([*KVTIERD, subcommand, "--bogus"])
    lines = done.stderr.splitlines()
    assert (done.returncode, done.stdout) == (2, "")
    assert lines[0].startswith(f"usage: kvtierd {subcommand} [-h]"), done.stderr
    assert lines[-1] == f"kvtierd {subcommand}: error: unrecognized arguments: --bogus"
    top = run([*KVTIERD, "--bogus", subcommand])
    assert top.returncode == 2 and top.stderr.startswith("usage: kvtierd [-h]"), top.stderr
    assert top.stderr.splitlines()[-1] == "kvtierd: error: unrecognized arguments: --bogus"


@pytest.mark.parametrize("subcommand", ["stats", "evict", "drain", "health"])
def test_kvtierctl_points_a_subcommands_unknown_argument_at_its_help(subcommand, tmp_path):
    """`kvtierctl health --bogus`: one line naming `kvtierctl health --help`, exit 2, nothing run."""
    done = run([*KVTIERCTL, "--address", f"unix://{tmp_path}/none.sock", subcommand, "--bogus"])
    assert (done.returncode, done.stdout, done.stderr) == (
        2, "", f"kvtierctl: error: unrecognized arguments: --bogus (see `kvtierctl {subcommand} --help`)\n")


# ----------------------------------------------------------------------------- flags that do not apply


def test_demo_refuses_random_model_flags_without_random_weights_before_loading_a_model(tmp_path):
    """`kvtierd demo --layers 1 --hidden 64` is one line and exit 2 within seconds: no model is fetched."""
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "HOME": str(tmp_path)}
    started_s = time.monotonic()
    done = subprocess.run([*KVTIERD, "demo", "--layers", "1", "--hidden", "64"], capture_output=True, text=True,
                          env=env, timeout=60)
    assert (done.returncode, done.stdout, done.stderr) == (
        2, "", "kvtierd: error: --layers, --hidden apply only with --random-weights\n")
    assert time.monotonic() - started_s < 30  # importing torch, no more
    assert not (tmp_path / "cache").exists()  # SmolLM2 is fetched there: nothing was


# ----------------------------------------------------------------------------- plurals


def test_stats_counts_one_session_as_one(daemon):
    """With one session attached the header reads "1 session", not "1 sessions"."""
    with KvtierClient(daemon.address) as client:
        session = client.attach(LAYOUT)
        try:
            done = run([*KVTIERCTL, "--address", daemon.address, "stats"])
        finally:
            session.close()
    assert done.returncode == 0, done.stderr
    assert ": 1 session, 0 block refs reclaimed from dead sessions" in done.stdout.splitlines()[0]
