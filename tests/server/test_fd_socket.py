"""The fd socket (`<socket>.fds`): the pool's descriptor goes once, to the uid the Attach bound,
for an open session; anything else is one `refused:` line and no descriptor. Socket group and
mode come from server.socket_group / socket_mode, and bad values are refused at start."""

from __future__ import annotations

import asyncio
import grp
import os
import shutil
import socket
import stat
import tempfile
from pathlib import Path

import pytest

from kvtierd.client import KvtierClient
from kvtierd.client.calls import attach_call
from kvtierd.client.fd_channel import FdChannel
from kvtierd.errors import FailedPrecondition, PermissionDenied
from kvtierd.launch.daemon_process import DaemonProcess, wait_until
from kvtierd.server.fd_listener import FdListener
from kvtierd.t0.shm_segment import ShmSegment
from kvtierd.wire.fd_passing import GREETING
from tests.server.e2e_runner import LAYOUT, compute, prompt
from tests.server.test_startup_refusals import SMALL, assert_refused, serve_until_refused


@pytest.fixture(scope="module")
def daemon():
    """A daemon whose sockets are mode 0660, in the test process's own group."""
    directory = tempfile.mkdtemp(prefix="kvfd-", dir="/tmp")
    args = ["--socket", f"{directory}/kvtierd.sock", "--ssd-dir", "", *SMALL,
            "--set", f"server.socket_group={os.getgid()}", "--set", "server.socket_mode=0660"]
    with DaemonProcess(args) as process:
        yield process
    shutil.rmtree(directory, ignore_errors=True)


def socket_path(daemon: DaemonProcess) -> str:
    return daemon.unix_address.removeprefix("unix://")


def raw_attach(client: KvtierClient, channel: FdChannel | None, fd_peer: str | None = None):
    """An Attach naming `channel`'s token (or `fd_peer`): the response, whose pool carries the ticket."""
    peer = fd_peer if fd_peer is not None else channel.peer_token
    return client._run(attach_call(LAYOUT, "sha256", client.timeout_s, None, peer))


def test_both_sockets_get_the_configured_group_and_mode(daemon):
    for path in (socket_path(daemon), socket_path(daemon) + ".fds"):
        status = os.stat(path)
        assert stat.S_ISSOCK(status.st_mode) and stat.S_IMODE(status.st_mode) == 0o660, path
        assert status.st_gid == os.getgid()


def test_attach_maps_the_pool_by_descriptor_and_never_by_name(daemon, monkeypatch):
    """With opening by name made impossible, a runner stores blocks and gets them back as hits."""
    def no_names(*args):
        raise AssertionError("the client opened the pool by name")
    monkeypatch.setattr(ShmSegment, "attach", no_names)
    with KvtierClient(daemon.address) as client:
        with client.attach(LAYOUT) as session:
            stored = compute(session, "a", prompt(11, 64))
        with client.attach(LAYOUT) as session:
            seen = compute(session, "b", prompt(11, 64))
    assert stored["num_hits"] == 0 and stored["num_blocks"] == 16
    assert seen["num_hits"] == 16 and seen["num_mismatched"] == 0


def test_a_ticket_is_good_once(daemon):
    with KvtierClient(daemon.address) as client, FdChannel.connect(socket_path(daemon)) as channel:
        ticket = raw_attach(client, channel).pool.fd_ticket
        assert len(ticket) == 32
        fd = channel.receive_fd(ticket)
        try:
            assert os.fstat(fd).st_size >= LAYOUT.bytes_per_block
        finally:
            os.close(fd)
        with FdChannel.connect(socket_path(daemon)) as again:
            with pytest.raises(PermissionDenied, match="unknown or already used ticket"):
                again.receive_fd(ticket)


def test_a_wrong_ticket_gets_no_descriptor(daemon):
    with FdChannel.connect(socket_path(daemon)) as channel:
        with pytest.raises(PermissionDenied, match="unknown or already used ticket"):
            channel.receive_fd("0" * 32)


def test_a_ticket_of_a_closed_session_is_refused(tmp_path):
    """The session's lease ran out before its ticket came: refused, no descriptor."""
    args = ["--socket", f"{tmp_path}/kvtierd.sock", "--ssd-dir", "", *SMALL, "--lease-s", "0.5"]
    with DaemonProcess(args) as process, KvtierClient(process.address) as client, \
            FdChannel.connect(socket_path(process)) as channel:
        ticket = raw_attach(client, channel).pool.fd_ticket
        assert wait_until(lambda: client.stats().num_sessions == 0)
        with pytest.raises(PermissionDenied, match="is closed"):
            channel.receive_fd(ticket)


def test_an_attach_naming_no_open_fd_connection_is_refused(daemon):
    with KvtierClient(daemon.address) as client:
        with pytest.raises(FailedPrecondition, match="fd_peer names no open connection"):
            raw_attach(client, None, fd_peer="f" * 32)


def test_a_ticket_presented_by_another_uid_is_refused(tmp_path):
    """The ticket is bound to the uid of the Attach's fd connection: any other uid gets a refusal."""
    path = str(tmp_path / "s.fds")

    async def main() -> str:
        listening = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listening.bind(path)
        listening.listen()
        listener = FdListener(listening)
        listener.start()
        served = os.memfd_create("pool")
        ticket = listener.issue(os.getuid() + 4242, "session", lambda: served, lambda: True)
        try:
            with await asyncio.to_thread(FdChannel.connect, path[:-len(".fds")]) as channel:
                with pytest.raises(PermissionDenied) as refused:
                    await asyncio.to_thread(channel.receive_fd, ticket)
            return str(refused.value)
        finally:
            await listener.stop()
            os.close(served)

    message = asyncio.run(main())
    assert f"issued to uid {os.getuid() + 4242}, presented by uid {os.getuid()}" in message


def test_the_greeting_names_a_fresh_peer_per_connection(daemon):
    with FdChannel.connect(socket_path(daemon)) as first, FdChannel.connect(socket_path(daemon)) as second:
        assert first.peer_token != second.peer_token and len(first.peer_token) == 32
    with socket.socket(socket.AF_UNIX) as raw:
        raw.connect(socket_path(daemon) + ".fds")
        assert raw.recv(256).decode().startswith(GREETING)


@pytest.fixture
def short_dir():
    directory = Path(tempfile.mkdtemp(prefix="kv-", dir="/tmp"))
    yield directory
    shutil.rmtree(directory)


def unknown_group() -> str:
    names = {group.gr_name for group in grp.getgrall()}
    return next(f"kvtierd-nogroup-{i}" for i in range(1000) if f"kvtierd-nogroup-{i}" not in names)


@pytest.mark.parametrize("flags, names", [
    (lambda: ["--set", f"server.socket_group={unknown_group()}"], ("server.socket_group", "no group")),
    (lambda: ["--set", "server.socket_mode=rw-rw----"], ("server.socket_mode", "octal")),
    (lambda: ["--set", "server.socket_mode=0460"], ("server.socket_mode", "owner")),
], ids=["unknown-group", "mode-not-octal", "mode-without-owner-rw"])
def test_bad_socket_group_or_mode_is_refused_at_start(flags, names, short_dir, tmp_path):
    """Exit 2 and one line naming the setting; no socket is left behind."""
    args = ["--socket", short_dir / "run" / "kvtierd.sock", "--ssd-dir", tmp_path / "ssd", *SMALL, *flags()]
    assert_refused(*serve_until_refused(args, tmp_path), names)
    assert not (short_dir / "run").exists()
