"""The daemon's listeners: it removes only the socket file it bound, and a failed bind is one
error naming the setting and the cause, with grpc's own log line kept off stderr."""

from __future__ import annotations

import asyncio
import os
import socket

import grpc
import pytest

from kvtierd.errors import FailedPrecondition
from kvtierd.server.listeners import add_port, bind_unix_socket


def bound_and_removed(path: str, replace: bool) -> None:
    """Bind a server to `path`, optionally put another socket file in its place, then remove()."""
    async def run() -> None:
        server = grpc.aio.server()
        socket_file = bind_unix_socket(server, path, "--socket")
        if replace:
            os.unlink(path)
            with socket.socket(socket.AF_UNIX) as other:
                other.bind(path)
        socket_file.remove()
        await server.stop(0)

    asyncio.run(run())


def test_remove_unlinks_the_bound_socket_and_the_directories_made_for_it(tmp_path):
    path = tmp_path / "made" / "for-it" / "kvtierd.sock"
    bound_and_removed(str(path), replace=False)
    assert not (tmp_path / "made").exists()


def test_remove_leaves_a_socket_file_that_replaced_ours(tmp_path):
    """The path is another file now (another daemon's socket): it stays, and so does its directory."""
    path = tmp_path / "run" / "kvtierd.sock"
    bound_and_removed(str(path), replace=True)
    assert path.is_socket()


def test_a_busy_port_names_the_setting_and_the_cause_and_grpc_logs_nothing(capfd):
    async def run() -> None:
        with socket.socket() as listener:
            listener.bind(("127.0.0.1", 0))
            listener.listen()
            server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
            with pytest.raises(FailedPrecondition, match=r"^--tcp \(server.tcp\): cannot listen on 127.0.0.1:\d+: "
                                                         r"Address already in use"):
                add_port(server, f"127.0.0.1:{listener.getsockname()[1]}", "--tcp (server.tcp)")
            await server.stop(0)

    asyncio.run(run())
    assert capfd.readouterr().err == ""
