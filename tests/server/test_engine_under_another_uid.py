"""A runner under another uid than the daemon's, without privileges: it attaches through the
socket's group, gets the pool as a descriptor (never opening its /dev/shm name, which is the
daemon's, mode 0600), stores blocks and gets them back as hits with the right bytes. A uid outside
the group cannot connect, and a ticket handed to another uid is refused.

Needs root (to create a group and two users with groupadd/useradd, removed afterwards, and to
let them reach this interpreter: /root gets o+x for the module, then its mode back)."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from kvtierd.client import KvtierClient
from kvtierd.client.fd_channel import FdChannel
from kvtierd.launch.daemon_process import DaemonProcess
from tests import other_uid
from tests.conftest import REPO
from tests.server.test_fd_socket import raw_attach
from tests.server.test_startup_refusals import SMALL

accounts = other_uid.accounts  # the fixture: (group, a user in it, a user outside it)

RUNNER = """
import json, os, sys
from kvtierd.client import KvtierClient
from kvtierd.errors import KvtierError
from tests.server.e2e_runner import LAYOUT, compute, prompt
try:
    with KvtierClient(os.environ["KVTIERD_ADDRESS"]) as client:
        session = client.attach(LAYOUT)
        seen = compute(session, "r", prompt(int(sys.argv[1]), 64))
        seen.update(uid=os.getuid(), pool=type(session.pool).__name__)
        session.release("r")
        session.close()
except KvtierError as error:
    print(f"kvtierd: error: {error}")
    sys.exit(1)
print(json.dumps(seen))
"""
PRESENT_TICKET = """
import sys
from kvtierd.client.fd_channel import FdChannel
from kvtierd.errors import KvtierError
try:
    with FdChannel.connect(sys.argv[1]) as channel:
        channel.receive_fd(sys.argv[2])
except KvtierError as error:
    print(f"kvtierd: error: {error}")
    sys.exit(1)
print("got a descriptor")
"""


@pytest.fixture(scope="module")
def daemon(accounts):
    """The daemon as root, its sockets mode 0660 in the test group, in a directory it makes."""
    group, _, _ = accounts
    base = Path(tempfile.mkdtemp(prefix="kvu-", dir="/tmp"))
    base.chmod(0o755)
    (base / "home").mkdir(mode=0o777)
    (base / "home").chmod(0o777)
    args = ["--socket", base / "run" / "kvtierd.sock", "--ssd-dir", "", *SMALL,
            "--set", f"server.socket_group={group}", "--set", "server.socket_mode=0660"]
    with DaemonProcess(list(map(str, args))) as process:
        yield process, base
    shutil.rmtree(base, ignore_errors=True)


def run_as(user: str, base: Path, address: str, script: str, *args: str,
           trace: Path | None = None) -> subprocess.CompletedProcess:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(base / "home"), "PYTHONPATH": str(REPO),
           "KVTIERD_ADDRESS": address}
    command = ["runuser", "-u", user, "--", sys.executable, "-P", "-c", script, *args]
    if trace is not None:
        command = ["strace", "-f", "-qq", "-e", "trace=open,openat,openat2", "-o", str(trace), *command]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)


def test_a_runner_in_the_group_stores_and_hits_through_the_descriptor(accounts, daemon):
    """Two runner processes of the other uid: the first stores 16 blocks, the second gets all 16
    back as T0 hits with the bytes the first wrote; neither opened the daemon's segment by name."""
    _, inside, _ = accounts
    process, base = daemon
    segments = [path for path in Path("/dev/shm").glob(f"kvtierd-pool-{process.pid}-*")]
    runs = []
    for attempt in range(2):
        trace = base / f"trace-{attempt}.txt" if shutil.which("strace") else None
        done = run_as(inside, base, process.address, RUNNER, "5", trace=trace)
        assert done.returncode == 0, done.stdout + done.stderr
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
        if trace is not None:
            opened = [line for line in trace.read_text().splitlines() if "/dev/shm/" in line]
            assert not opened, opened
    segments = segments or list(Path("/dev/shm").glob(f"kvtierd-pool-{process.pid}-*"))
    assert segments, "the daemon's pool segment is not in /dev/shm"
    for path in segments:  # only the daemon's uid could open it by name
        status = path.stat()
        assert stat.S_IMODE(status.st_mode) == 0o600 and status.st_uid == os.getuid()
    uid = pwd.getpwnam(inside).pw_uid
    assert runs[0] == {"num_blocks": 16, "num_hits": 0, "num_t0_hits": 0, "num_mismatched": 0, "num_held": 16,
                       "uid": uid, "pool": "ShmDevicePool"}
    assert runs[1]["num_hits"] == 16 and runs[1]["num_t0_hits"] == 16 and runs[1]["num_mismatched"] == 0


def test_a_uid_outside_the_group_cannot_connect(accounts, daemon):
    """Permission denied at the socket, as one line from the client; the daemon serves on."""
    _, _, outside = accounts
    process, base = daemon
    done = run_as(outside, base, process.address, RUNNER, "6")
    assert done.returncode == 1, done.stdout + done.stderr
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvtierd: error: ") and "permission denied" in lines[0], lines
    assert process.process.poll() is None


def test_a_ticket_handed_to_another_uid_is_refused(accounts, daemon):
    """The Attach bound the ticket to this process's uid: the group's user presenting it gets no fd."""
    _, inside, _ = accounts
    process, base = daemon
    path = process.unix_address.removeprefix("unix://")
    with KvtierClient(process.address) as client, FdChannel.connect(path) as channel:
        ticket = raw_attach(client, channel).pool.fd_ticket
        done = run_as(inside, base, process.address, PRESENT_TICKET, path, ticket)
    assert done.returncode == 1, done.stdout + done.stderr
    uid = pwd.getpwnam(inside).pw_uid
    assert done.stdout.strip() == (f"kvtierd: error: kvtierd's fd socket {path}.fds refused the pool: "
                                   f"ticket issued to uid {os.getuid()}, presented by uid {uid}")
