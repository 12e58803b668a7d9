"""`kvtierd serve` refuses each start-up mistake before `ready`: exit status 2, one line on stderr
naming the setting, no traceback, and nothing left behind. A second daemon on a running daemon's
socket or SSD directory is refused the same way, and the first keeps its socket and its lock."""

from __future__ import annotations

import dataclasses
import fcntl
import os
import shutil
import socket
import stat
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest

from kvtierd.client import KvtierClient
from kvtierd.launch.daemon_process import READY_LINE, DaemonProcess, python_module_command, wait_until
from kvtierd.t2.directory_lock import LOCK_FILE_NAME

SMALL = ["--metrics-port", "-1", "--device", "cpu", "--t0-bytes", "4MiB", "--host-bytes", "8MiB",
         "--ssd-bytes", "16MiB"]
NO_SSD_BYTES = SMALL[:-2]  # the SSD budget left to its default, bounded by the disk
FILE_TEXT = "a regular file, not a socket\n"
MISSING = "missing.pem"  # a file name nobody creates
NOT_CREATABLE = "/proc/kvtierd-nope"  # mkdir says ENOENT there, even to root
# Root without CAP_DAC_OVERRIDE (and what could stand in for it) obeys a directory's mode like anyone.
AS_ROOT_WITHOUT_OVERRIDE = ["setpriv", "--bounding-set=-dac_override,-dac_read_search",
                            "--inh-caps=-dac_override,-dac_read_search"] if os.geteuid() == 0 else []


def tmpfs_over(options: str, fill: bool = False) -> list[str]:
    """A command prefix: a tmpfs mounted with `options` over `$0` in a mount namespace of the
    daemon's own (nothing outside it sees the mount), filled up first with `fill`."""
    then = ' && { cat /dev/zero > "$0/fill" 2>/dev/null; true; }' if fill else ""
    return ["unshare", "--mount", "--map-root-user", "sh", "-c",
            f'mount -t tmpfs -o {options} kvtierd-tmp "$0"{then} && exec "$@"']


# A read-only directory that holds even for root: a read-only tmpfs.
READ_ONLY_MOUNT = tmpfs_over("ro,size=64k")


@dataclasses.dataclass(frozen=True)
class Place:
    """Where one refused start may leave things: `short` (socket paths must stay short) and `tmp`.
    Neither `socket`'s directory nor `ssd` exists beforehand; `afile` is a regular file."""

    short: Path
    tmp: Path
    busy_port: int  # a port someone else listens on

    @property
    def socket(self) -> Path:
        return self.short / "run" / "kvtierd.sock"

    @property
    def ssd(self) -> Path:
        return self.tmp / "ssd"

    @property
    def afile(self) -> Path:
        return self.short / "afile"

    @property
    def read_only(self) -> Path:  # read-only for a case run with read_only_mount; a tmpfs with `mount`
        return self.tmp / "read-only"

    @property
    def mode_0555(self) -> Path:  # a directory nobody may write in (but root with CAP_DAC_OVERRIDE)
        return self.tmp / "mode-0555"

    @property
    def missing(self) -> Path:
        return self.tmp / MISSING


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    flags: Callable[[Place], list]  # after the base flags, so they override them
    names: tuple[str, ...]  # what the error line must name: the flag, the config key
    read_only_mount: bool = False
    mount: str = ""  # the options of a tmpfs mounted over `read_only` ("": none)
    fill: bool = False  # that tmpfs filled up before the daemon starts
    base: tuple[str, ...] = tuple(SMALL)  # the flags before `flags`
    prefix: tuple[str, ...] = ()  # a command the daemon runs under


def tls(place: Place, **files: Path) -> list:
    """TCP with TLS; `files` replaces cert, key or client_ca (each an existing file by default)."""
    paths = {"cert": place.afile, "key": place.afile, "client_ca": place.afile} | files
    return ["--tcp", "127.0.0.1:0", "--tls-cert", paths["cert"], "--tls-key", paths["key"],
            "--tls-client-ca", paths["client_ca"]]


CASES = (
    Case("tcp-port-in-use", lambda p: ["--tcp", f"127.0.0.1:{p.busy_port}", "--insecure-tcp"],
         ("--tcp", "server.tcp", "Address already in use")),
    Case("health-port-in-use", lambda p: ["--health-tcp", f"127.0.0.1:{p.busy_port}"],
         ("--health-tcp", "server.health_tcp", "Address already in use")),
    Case("metrics-port-in-use", lambda p: ["--metrics-port", p.busy_port],
         ("--metrics-port", "server.metrics_port", "Address already in use")),
    Case("socket-directory-under-a-file", lambda p: ["--socket", p.afile / "sub" / "kvtierd.sock"],
         ("--socket", "server.socket", "is not a directory")),
    Case("socket-directory-read-only", lambda p: ["--socket", p.read_only / "kvtierd.sock"],
         ("--socket", "server.socket", "not writable"), read_only_mount=True),
    Case("socket-path-too-long", lambda p: ["--socket", p.short / ("s" * 120 + ".sock")],
         ("--socket", "server.socket", "107")),
    Case("socket-path-is-a-file", lambda p: ["--socket", p.afile], ("--socket", "server.socket", "not a socket")),
    Case("ssd-directory-under-a-file", lambda p: ["--ssd-dir", p.afile / "sub"],
         ("--ssd-dir", "ssd.directory", "is not a directory")),
    Case("ssd-directory-read-only", lambda p: ["--ssd-dir", p.read_only],
         ("--ssd-dir", "ssd.directory", "not writable"), read_only_mount=True),
    Case("ssd-bytes-beyond-free-room", lambda p: ["--ssd-bytes", "1000TiB"],
         ("--ssd-bytes", "ssd.capacity_bytes", "free")),
    Case("ssd-directory-not-creatable", lambda p: ["--ssd-dir", NOT_CREATABLE],
         ("--ssd-dir", "ssd.directory", f"cannot create the directory {NOT_CREATABLE}"), base=tuple(NO_SSD_BYTES)),
    Case("ssd-directory-not-creatable-with-a-budget", lambda p: ["--ssd-dir", NOT_CREATABLE],
         ("--ssd-dir", "ssd.directory", f"cannot create the directory {NOT_CREATABLE}")),
    Case("ssd-directory-is-a-file", lambda p: ["--ssd-dir", p.afile],
         ("--ssd-dir", "ssd.directory", "afile is not a directory")),
    Case("ssd-directory-mode-0555", lambda p: ["--ssd-dir", p.mode_0555],
         ("--ssd-dir", "ssd.directory", "not writable", "Permission denied"), prefix=tuple(AS_ROOT_WITHOUT_OVERRIDE)),
    Case("ssd-filesystem-full", lambda p: ["--ssd-dir", p.read_only / "ssd"],
         ("--ssd-dir", "ssd.directory", "not writable", "No space left on device"), mount="size=256k", fill=True),
    Case("ssd-filesystem-without-room-for-a-default-budget", lambda p: ["--ssd-dir", p.read_only / "ssd"],
         ("--ssd-dir", "ssd.directory", "no room for T2", "--ssd-bytes (ssd.capacity_bytes) not set", "64.0 MiB"),
         mount="size=1m", base=tuple(NO_SSD_BYTES)),
    Case("host-bytes-beyond-memory", lambda p: ["--host-bytes", "100TiB"],
         ("--host-bytes", "host.capacity_bytes", "memory")),
    Case("t0-bytes-beyond-dev-shm", lambda p: ["--device", "cpu", "--t0-bytes", "100TiB"],
         ("--t0-bytes", "pool.t0_bytes", "/dev/shm")),
    Case("device-not-on-this-machine", lambda p: ["--device", "cuda:99"], ("--device", "pool.device")),
    Case("tls-cert-missing", lambda p: tls(p, cert=p.missing), ("--tls-cert", "server.tls_cert", MISSING)),
    Case("tls-key-unreadable", lambda p: tls(p, key=p.tmp), ("--tls-key", "server.tls_key", "Is a directory")),
    Case("tls-client-ca-missing", lambda p: tls(p, client_ca=p.missing),
         ("--tls-client-ca", "server.tls_client_ca", MISSING)),
    Case("remote-password-file-missing",
         lambda p: ["--set", "remote.endpoints=127.0.0.1:1", "--set", f"remote.password_file={p.missing}"],
         ("remote.password_file", MISSING)),
)


@pytest.fixture
def short_dir():
    """A directory with a short path: a unix socket path holds at most 107 bytes."""
    directory = Path(tempfile.mkdtemp(prefix="kv-", dir="/tmp"))
    yield directory
    shutil.rmtree(directory)


@pytest.fixture
def busy_port():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        yield listener.getsockname()[1]


@pytest.fixture(scope="module")
def read_only_mounts(tmp_path_factory) -> bool:
    """Whether READ_ONLY_MOUNT works here (it needs unshare and user or mount namespaces)."""
    target = tmp_path_factory.mktemp("probe")
    try:
        done = subprocess.run([*READ_ONLY_MOUNT, target, "sh", "-c", '! touch "$0/x" 2>/dev/null', target],
                              capture_output=True, timeout=60)
    except FileNotFoundError:
        return False
    return done.returncode == 0


def snapshot(*roots: Path) -> dict[str, str]:
    """Every path under `roots`: a file's text, a directory's or socket's kind."""
    found = {}
    for root in roots:
        for path in [root, *root.rglob("*")]:
            mode = path.lstat().st_mode
            found[str(path)] = path.read_text() if stat.S_ISREG(mode) else stat.filemode(mode)[0]
    return found


def serve_until_refused(args: list, out_dir: Path, prefix: list = ()) -> tuple[int, str, str]:
    """Run `kvtierd serve args` until it exits: (status, stdout, stderr). One that gets ready
    instead is stopped, and the test fails."""
    command = [*map(str, prefix), *python_module_command("kvtierd.cli.kvtierd_main", "serve", *map(str, args))]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIERD_")}
    stdout_path, stderr_path = out_dir / "stdout", out_dir / "stderr"
    with open(stdout_path, "w") as stdout, open(stderr_path, "w") as stderr:
        process = subprocess.Popen(command, stdout=stdout, stderr=stderr, env=env)
    try:
        wait_until(lambda: process.poll() is not None or READY_LINE in stdout_path.read_text(), timeout_s=120)
    finally:
        if process.poll() is None:
            process.terminate()
            process.wait(60)
            pytest.fail(f"kvtierd serve did not refuse:\n{stdout_path.read_text()}{stderr_path.read_text()}")
    return process.returncode, stdout_path.read_text(), stderr_path.read_text()


def assert_refused(status: int, stdout: str, stderr: str, names: tuple[str, ...]) -> None:
    assert status == 2, stdout + stderr
    assert READY_LINE not in stdout
    assert "Traceback" not in stderr
    lines = stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvtierd: error: "), stderr
    for name in names:
        assert name in lines[0], (name, lines[0])


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_a_start_up_mistake_is_one_line_naming_the_setting_and_leaves_nothing(case, short_dir, tmp_path,
                                                                             busy_port, read_only_mounts):
    """Exit 2, one `kvtierd: error:` line naming the setting, and every path as it was before."""
    if (case.read_only_mount or case.mount) and not read_only_mounts:
        pytest.skip("no tmpfs mount here (unshare --mount --map-root-user failed); root writes everywhere else")
    place = Place(short_dir, tmp_path / "place", busy_port)
    place.tmp.mkdir()
    place.read_only.mkdir()
    place.mode_0555.mkdir(mode=0o555)
    place.afile.write_text(FILE_TEXT)
    before = snapshot(place.short, place.tmp)
    args = ["--socket", place.socket, "--ssd-dir", place.ssd, *case.base, *case.flags(place)]
    prefix = [*READ_ONLY_MOUNT, place.read_only] if case.read_only_mount else []
    if case.mount:
        prefix = [*tmpfs_over(case.mount, case.fill), place.read_only]
    prefix += case.prefix
    assert_refused(*serve_until_refused(args, tmp_path, prefix), case.names)
    assert snapshot(place.short, place.tmp) == before


@pytest.fixture(scope="module")
def first_daemon(tmp_path_factory):
    """A running daemon, its socket path and SSD directory."""
    short = Path(tempfile.mkdtemp(prefix="kv-", dir="/tmp"))
    ssd = tmp_path_factory.mktemp("first") / "ssd"
    try:
        with DaemonProcess(["--socket", str(short / "kvtierd.sock"), "--ssd-dir", str(ssd), *SMALL]) as daemon:
            yield daemon, short / "kvtierd.sock", ssd
    finally:
        shutil.rmtree(short)


SECOND_DAEMONS = (
    ("same-socket", lambda socket_path, ssd, place: ["--socket", socket_path, "--ssd-dir", place.ssd],
     ("--socket", "server.socket", "another process is serving")),
    ("same-ssd-directory", lambda socket_path, ssd, place: ["--socket", place.socket, "--ssd-dir", ssd],
     ("--ssd-dir", "ssd.directory", "in use by another kvtierd")),
)


@pytest.mark.parametrize("flags, names", [case[1:] for case in SECOND_DAEMONS], ids=[c[0] for c in SECOND_DAEMONS])
def test_a_second_daemon_is_refused_and_the_first_keeps_its_socket_and_lock(flags, names, first_daemon, short_dir,
                                                                             tmp_path):
    """The refused daemon names the setting (and the first daemon's pid, for the SSD lock); the
    first's socket is the same file and answers, its lock is held, its pid still in the lock file."""
    daemon, socket_path, ssd = first_daemon
    socket_inode = socket_path.stat().st_ino
    lock_path = ssd / LOCK_FILE_NAME
    place = Place(short_dir, tmp_path / "place", 0)
    place.tmp.mkdir()
    before = snapshot(place.short, place.tmp)
    status, stdout, stderr = serve_until_refused([*SMALL, *flags(socket_path, ssd, place)], tmp_path)
    assert_refused(status, stdout, stderr, names)
    if "--ssd-dir" in names:
        assert f"(pid {daemon.pid})" in stderr
    assert snapshot(place.short, place.tmp) == before
    assert stat.S_ISSOCK(socket_path.lstat().st_mode) and socket_path.stat().st_ino == socket_inode
    with KvtierClient(daemon.address) as client:
        assert client.stats().num_sessions == 0
    assert lock_path.read_text() == f"{daemon.pid}\n"
    fd = os.open(lock_path, os.O_RDONLY)
    try:
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(fd)
