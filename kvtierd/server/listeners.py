"""Where the daemon listens: the unix socket file it owns, and gRPC binds that fail as an
operator's error.

The socket file: `bind_unix_socket` refuses a path another process serves on or that is not a
socket, removes a stale socket (nobody accepts on it), and remembers the bound file's identity
(st_dev, st_ino). `SocketFile.remove()` unlinks the path only while it is still that file, so a
daemon never removes a socket another daemon bound there, and removes the directories it made
for the socket while they are empty. (grpc itself unlinks the path when a started server stops.)

Binds: grpcio 1.85 raises RuntimeError("Failed to bind to address ...") where older versions
returned port 0, and logs the cause on file descriptor 2. `add_port` takes both for a failure,
keeps grpc's log line off stderr (a refused start prints one line) and raises FailedPrecondition
naming the setting and the cause ("Address already in use").
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import socket
import stat
import sys
import tempfile

import grpc

from kvtierd.errors import FailedPrecondition, InvalidArgument

MAX_UNIX_PATH_BYTES = 107  # Linux: sun_path holds 108 bytes, the terminating NUL included
_BIND_CAUSE = re.compile(r"Error in bind for address '[^']*': ([^)\n]+)")
_ADD_PORT_CAUSE = re.compile(r"Failed to add port to server: ([^\n]+)")


@dataclasses.dataclass(slots=True)
class SocketFile:
    """A unix socket file this daemon bound. `identity` is (st_dev, st_ino) right after the bind."""

    path: str
    identity: tuple[int, int]
    created_directories: list[str]  # made for this socket, innermost first

    def remove(self) -> None:
        """Unlink the socket while the path is still the file we bound; then the directories we
        made for it, while empty."""
        with contextlib.suppress(FileNotFoundError):
            status = os.lstat(self.path)
            if (status.st_dev, status.st_ino) == self.identity:
                os.unlink(self.path)
        remove_empty_directories(self.created_directories)


def bind_unix_socket(server: grpc.aio.Server, path: str, setting: str) -> SocketFile:
    """Bind `server` to the unix socket `path` (mode 0600), refusing as `prepare_socket_path` does."""
    created_directories = prepare_socket_path(path, setting)
    try:
        with _umask(0o177):
            add_port(server, "unix:" + path, setting)
        status = os.lstat(path)
    except BaseException:
        remove_empty_directories(created_directories)
        raise
    return SocketFile(path, (status.st_dev, status.st_ino), created_directories)


def bind_fd_socket(path: str, setting: str) -> tuple[socket.socket, SocketFile]:
    """A listening unix socket at `path` (mode 0600 until `apply_socket_access`), for the fd
    socket (fd_listener.py); refused as `prepare_socket_path` does."""
    created_directories = prepare_socket_path(path, setting)
    listening = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        with _umask(0o177):
            listening.bind(path)
        listening.listen(64)
        status = os.lstat(path)
    except OSError as e:
        listening.close()
        remove_empty_directories(created_directories)
        raise FailedPrecondition(f"{setting}: cannot listen on {path}: {e.strerror}") from None
    return listening, SocketFile(path, (status.st_dev, status.st_ino), created_directories)


def apply_socket_access(path: str, group_id: int | None, mode: int) -> None:
    """Give the socket file at `path` to group `group_id` (None: leave it) and set its mode; who may
    connect is decided by these (connect(2) needs write permission on the socket file)."""
    if group_id is not None:
        os.chown(path, -1, group_id)
    os.chmod(path, mode)


def prepare_socket_path(path: str, setting: str) -> list[str]:
    """Make the socket's directory (0700 where we create it) and remove a stale socket file;
    refuse when another process is serving on it or the path is not a socket. Returns the
    directories it made, innermost first."""
    directory = os.path.dirname(os.path.abspath(path))
    missing = []
    while not os.path.lexists(directory):
        missing.append(directory)
        directory = os.path.dirname(directory)
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), mode=0o700, exist_ok=True)
    except OSError as e:
        raise FailedPrecondition(f"{setting}: cannot create the directory of {path}: {e.strerror}") from None
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return missing
    if not stat.S_ISSOCK(mode):
        raise InvalidArgument(f"{setting}: {path} exists and is not a socket; choose another path")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        os.unlink(path)  # stale: left by a daemon that did not exit cleanly
        return missing
    finally:
        probe.close()
    raise FailedPrecondition(f"{setting}: another process is serving on {path}; stop it or choose another path")


def remove_empty_directories(directories: list[str]) -> None:
    """rmdir each, innermost first, stopping at the first that is not empty (or gone)."""
    for directory in directories:
        try:
            os.rmdir(directory)
        except OSError:
            return


def add_port(server: grpc.aio.Server, address: str, setting: str,
             credentials: grpc.ServerCredentials | None = None) -> int:
    """`server.add_(in)secure_port(address)`; returns the bound port. A failed bind raises
    FailedPrecondition naming `setting` and the cause grpc logged."""
    with _fd2_captured() as captured:
        try:
            port = (server.add_secure_port(address, credentials) if credentials is not None
                    else server.add_insecure_port(address))
        except RuntimeError:
            port = 0
    if port:
        if captured:  # not about this bind (another thread's, say): put it back
            os.write(2, captured[0].encode())
        return port
    text = captured[0] if captured else ""
    match = _BIND_CAUSE.search(text) or _ADD_PORT_CAUSE.search(text)
    cause = f": {match.group(1).strip()}" if match else ""
    raise FailedPrecondition(f"{setting}: cannot listen on {address}{cause}; choose another")


@contextlib.contextmanager
def _fd2_captured():
    """File descriptor 2 into a temporary file for the block; the list yielded then holds its
    text, when there was any."""
    sys.stderr.flush()
    captured: list[str] = []
    with tempfile.TemporaryFile() as sink:
        saved_fd = os.dup(2)
        os.dup2(sink.fileno(), 2)
        try:
            yield captured
        finally:
            os.dup2(saved_fd, 2)
            os.close(saved_fd)
            sink.seek(0)
            text = sink.read().decode(errors="replace")
            if text:
                captured.append(text)


@contextlib.contextmanager
def _umask(mask: int):
    previous = os.umask(mask)
    try:
        yield
    finally:
        os.umask(previous)
