"""A real vLLM engine (the CPU build) under another uid than the daemon's, without privileges: it
attaches through the socket's group (mode 0660), maps the pool from the descriptor it gets on
`<socket>.fds` and never opens the pool's /dev/shm name (the daemon's, mode 0600, root's); a
second engine process of that uid loads every full block the first stored and decodes the same.

Needs root: tests/other_uid.py creates the group and users (removed afterwards) and gives /root o+x
for the module (the venv's interpreter lives under /root/.pyenv), then its mode back. The users
get everything in a directory of their own under /tmp (mode 0755): the model, a HOME of mode 0777
for vLLM's caches, and a directory per engine (0777) to write its answer in.
"""

from __future__ import annotations

import grp
import json
import os
import pwd
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

import pytest

from kvtierd.launch.daemon_process import DaemonProcess
from tests import other_uid
from tests.connectors.vllm.engine_process import EngineProcess, engine_env
from tests.connectors.vllm.test_vllm_engines import (
    BYTES_PER_BLOCK,
    ENGINE_MAIN,
    MAX_TOKENS,
    NUM_T0_BLOCKS,
    SAVE_TINY_LLAMA,
    SHARED_PREFIX_LEN,
    SHARED_PROMPTS,
    hit_cap,
)

accounts = other_uid.accounts  # the fixture: (group, a user in it, a user outside it)

ENGINE_TIMEOUT_S = 600  # start-up under strace, beside other tests on 2 cores


@pytest.fixture(scope="module")
def place(accounts):
    """A directory the other uid can read (mode 0755), with a HOME and a TMPDIR it can write (0777)."""
    base = Path(tempfile.mkdtemp(prefix="kvve-", dir="/tmp"))
    base.chmod(0o755)
    for home in (base / "home", base / "home" / "tmp"):
        home.mkdir()
        home.chmod(0o777)
    yield base
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="module")
def model_dir(vllm_python, place) -> Path:
    """The tiny random Llama of test_vllm_engines.py, saved by root where the other uid reads it."""
    directory = place / "tiny-llama"
    directory.mkdir(mode=0o755)
    done = subprocess.run([vllm_python, "-P", "-c", SAVE_TINY_LLAMA, str(directory)], check=False,
                          capture_output=True, text=True, timeout=300, cwd=directory)
    if done.returncode != 0:
        pytest.fail(f"saving the tiny Llama failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    for path in directory.iterdir():
        path.chmod(0o644)  # safetensors writes its file 0600
    return directory


@pytest.fixture
def daemon(accounts, place):
    """`kvtierd serve` as root on the CPU, no SSD tier, its sockets mode 0660 in the test group,
    in a directory it makes."""
    group, _, _ = accounts
    args = ["--socket", str(place / "run" / "kvtierd.sock"), "--ssd-dir", "", "--metrics-port", "-1",
            "--device", "cpu", "--t0-bytes", f"{NUM_T0_BLOCKS * BYTES_PER_BLOCK}B", "--host-bytes", "64MiB",
            "--set", f"server.socket_group={group}", "--set", "server.socket_mode=0660"]
    with DaemonProcess(args) as process:
        yield process


def run_engine(vllm_python: str, model_dir: Path, place: Path, user: str, name: str,
               address: str) -> tuple[dict, Path | None]:
    """One engine process tree (vLLM's LLM process and its engine core, as `vllm serve` runs them)
    as `user`, under strace where it is installed: its answer and the trace of every file its
    processes opened (None without strace)."""
    directory = place / name
    directory.mkdir()
    directory.chmod(0o777)  # the engine writes its answer here (and runs here)
    prompts_json = directory / "prompts.json"
    prompts_json.write_text(json.dumps(SHARED_PROMPTS))
    home = place / "home"
    env = engine_env(VLLM_CACHE_ROOT=str(home / ".cache" / "vllm"), XDG_CACHE_HOME=str(home / ".cache"),
                     TORCHINDUCTOR_CACHE_DIR=str(home / ".cache" / "inductor"), TMPDIR=str(home / "tmp"))
    command = [vllm_python, "-P", str(ENGINE_MAIN), str(model_dir), str(directory / f"{name}.json"),
               "--prompts", str(prompts_json), "--max-tokens", str(MAX_TOKENS), "--address", address]
    trace = directory / "opened.trace" if shutil.which("strace") else None
    as_user = other_uid.as_user(user, str(home), command, trace=trace and str(trace))
    engine = EngineProcess(as_user, directory, name, env, timeout_s=ENGINE_TIMEOUT_S)
    try:
        result = engine.result()
    finally:
        if engine.process.poll() is None:
            engine.kill()
    assert engine.out_json.stat().st_uid == pwd.getpwnam(user).pw_uid  # written by the other uid
    return result, trace


def assert_never_opened_the_pool(trace: Path, model_dir: Path) -> None:
    """No process of the engine opened (or tried to open) a kvtierd pool by name; vLLM's own /dev/shm
    segments (its message queues) are other names. The trace did see the engine's files."""
    lines = trace.read_text(errors="replace").splitlines()
    assert any(f'"{model_dir}/config.json"' in line for line in lines), f"{trace} does not show the engine's opens"
    opened_pools = [line for line in lines if "kvtierd-pool-" in line]
    assert not opened_pools, opened_pools


@pytest.mark.timeout(2 * ENGINE_TIMEOUT_S + 300)
def test_a_vllm_engine_in_the_group_stores_and_a_second_one_hits_through_the_descriptor(
        accounts, vllm_python, model_dir, place, daemon):
    """Engine A of the other uid computes and stores 3 prompts behind a 256-token prefix; engine B, a
    new process of that uid, loads every full block of each prompt from kvtierd's T0 and decodes
    the tokens A decoded. Neither opened the daemon's segment, which only root may open."""
    group, inside, _ = accounts
    socket_path = daemon.unix_address.removeprefix("unix://")
    for path in (socket_path, socket_path + ".fds"):
        status = os.stat(path)
        assert stat.S_IMODE(status.st_mode) == 0o660 and status.st_gid == grp.getgrnam(group).gr_gid, path
    cold, cold_trace = run_engine(vllm_python, model_dir, place, inside, "cold", daemon.address)
    warm, warm_trace = run_engine(vllm_python, model_dir, place, inside, "warm", daemon.address)
    for trace in (cold_trace, warm_trace):  # without strace, the segment's mode below is the proof
        if trace is not None:
            assert_never_opened_the_pool(trace, model_dir)
    segments = list(Path("/dev/shm").glob(f"kvtierd-pool-{daemon.pid}-*"))
    assert segments, "the daemon's pool segment is not in /dev/shm"
    for path in segments:  # only the daemon's uid could open it by name
        status = path.stat()
        assert stat.S_IMODE(status.st_mode) == 0o600 and status.st_uid == os.getuid() == 0, (path, status)
    # An empty daemon: the first prompt computes everything. The engine's requests reach its core
    # one by one, so a later prompt scheduled after the first one's store may load the shared
    # prefix (its full blocks, nothing more), and only from what this engine stored.
    assert cold["num_cached_tokens"][0] == 0, cold
    assert set(cold["num_cached_tokens"][1:]) <= {0, SHARED_PREFIX_LEN}, cold
    loaded = cold["kvtierd_loaded_tokens"]
    assert set(loaded) <= {"t0"} and sum(loaded.values()) == sum(cold["num_cached_tokens"]), cold
    assert warm["num_cached_tokens"] == [hit_cap(prompt) for prompt in SHARED_PROMPTS], warm
    assert warm["kvtierd_loaded_tokens"] == {"t0": sum(warm["num_cached_tokens"])}, warm
    assert warm["output_token_ids"] == cold["output_token_ids"]
