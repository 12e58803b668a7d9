"""Whether a directory can hold the SSD tier, found by doing at start what the tier will do later.

A tier's files are opened only when a layout first attaches (its pool is created lazily), so a
directory that cannot hold them would otherwise show up as a node quietly without T2. The probe
creates the directory (and its missing parents), writes and fsyncs a probe file of one aligned
block there, opens it with O_DIRECT and reads it back when asked to, and reads the filesystem's
free space; then it removes the probe file and every directory it created, whatever happened, so
that a refused start leaves nothing behind.

O_DIRECT refused with EINVAL (at open or at the first read: tmpfs before Linux 6.6, ramfs, some
FUSE and network filesystems) is not a mistake: the tier falls back on buffered I/O there
(ssd_files.py), and the probe reports why. Any other error is one the tier would fail on too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import mmap
import os

from kvtierd.durable_files import write_synced
from kvtierd.units import ALIGNMENT_BYTES

PROBE_FILE_PREFIX = ".kvtierd-probe-"


class UnusableDirectory(Exception):
    """The directory cannot hold the SSD tier; the message says why (it names the path)."""


@dataclasses.dataclass(frozen=True, slots=True)
class DirectoryProbe:
    """What the probe found in a directory it could create and write."""

    free_bytes: int  # free for an unprivileged user, on the directory's filesystem
    o_direct_refused: str  # why O_DIRECT falls back on buffered I/O there; "" if it works or was not asked


def probe_directory(directory: str, o_direct: bool) -> DirectoryProbe:
    """Probe `directory` (module doc); UnusableDirectory when it cannot be created, is not a
    directory, or a file in it cannot be written, synced or opened as the tier would."""
    directory = os.path.abspath(directory)
    created = []
    try:
        for missing in missing_directories(directory):
            try:
                os.mkdir(missing)
            except OSError as e:
                raise UnusableDirectory(f"cannot create the directory {missing}: {e.strerror}") from None
            created.append(missing)
        refused = write_probe_file(directory, o_direct)
        status = os.statvfs(directory)
        return DirectoryProbe(status.f_bavail * status.f_frsize, refused)
    finally:
        for path in reversed(created):
            with contextlib.suppress(OSError):
                os.rmdir(path)


def missing_directories(directory: str) -> list[str]:
    """The directories to create for `directory` (an absolute path), outermost first; UnusableDirectory
    when it, or its nearest existing ancestor, is not a directory."""
    missing = []
    path = directory
    while not os.path.exists(path):
        missing.append(path)
        path = os.path.dirname(path)
    if not os.path.isdir(path):
        what = directory if path == directory else f"its ancestor {path}"
        raise UnusableDirectory(f"cannot use the directory {directory}: {what} is not a directory")
    return missing[::-1]


def write_probe_file(directory: str, o_direct: bool) -> str:
    """Write, fsync and (with `o_direct`) read back with O_DIRECT a one-block file in `directory`,
    then remove it; returns why O_DIRECT is refused ("" when it works or was not asked)."""
    path = os.path.join(directory, f"{PROBE_FILE_PREFIX}{os.getpid()}")
    block = mmap.mmap(-1, ALIGNMENT_BYTES)  # page aligned, as O_DIRECT wants
    try:
        try:
            write_synced(path, block)
        except OSError as e:
            raise UnusableDirectory(f"the directory {directory} is not writable: writing a file there failed: "
                                    f"{e.strerror}") from None
        return direct_read_refusal(path, block) if o_direct and hasattr(os, "O_DIRECT") else ""
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)
        block.close()


def direct_read_refusal(path: str, block: mmap.mmap) -> str:
    """Open `path` as the tier opens its slot files (O_RDWR | O_DIRECT) and read its first block;
    why the filesystem refuses that (EINVAL), or "" when it takes it."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_DIRECT | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == errno.EINVAL:
            return f"its filesystem refuses O_DIRECT at open ({e.strerror})"
        raise UnusableDirectory(f"cannot open a file in {os.path.dirname(path)} with O_DIRECT: {e.strerror}") from None
    try:
        os.preadv(fd, [block], 0)
    except OSError as e:
        if e.errno == errno.EINVAL:
            return f"its filesystem refuses O_DIRECT reads ({e.strerror})"
        raise UnusableDirectory(f"cannot read a file in {os.path.dirname(path)} with O_DIRECT: {e.strerror}") from None
    finally:
        os.close(fd)
    return ""
