"""Checking a DaemonConfig against this machine, before the daemon binds or creates anything.

`check_machine(config)` raises the first mistake it finds as one line naming the setting (flag
and config key). Nothing is left changed: nothing is bound, and the SSD probe removes the file and
the directories it made. It refuses

- server.socket: a path longer than a unix socket holds (107 bytes on Linux; its fd socket,
  `<socket>.fds`, too); a directory that cannot be created (a component is a file) or is not writable;
- server.socket_group: a group name this machine does not know (a gid is taken as it is);
- server.tls_cert, tls_key, tls_client_ca: a file that cannot be read;
- ssd.directory (when T2 is on: a directory and capacity_bytes > 0), found by trying what the
  tier does later (t2/ssd_probe.py: pools, and their T2, are created only when a layout
  attaches): a directory that cannot be created, or a file in it written, fsynced or opened with
  O_DIRECT (when ssd.o_direct; a filesystem that refuses O_DIRECT with EINVAL falls back on
  buffered I/O, as the tier does, and start-up says so); a filesystem without ssd.capacity_bytes
  free. The capacity is the node's budget: every layout's slot files together grow up to it as
  blocks are written; slot files already in the directory (`<directory>/*/kvtierd-slots.bin`, a
  restarted daemon's) count as free, since they are part of that budget. A default capacity
  (none set) is bounded by the free space (config_loader.py) and comes out 0 without room for
  a minimum budget: a directory the operator named is then refused too, after the same probe; the
  default directory leaves the node without T2, a problem health reports (ssd_state.py);
- host.capacity_bytes above the machine's memory (MemTotal), and pool.t0_bytes above the size of
  /dev/shm where the device pool lives there (the device resolves to the CPU);
- pool.device naming a CUDA device this machine lacks.

Writability of the socket's directory is os.access: root passes it everywhere but on a
read-only filesystem (EROFS); the SSD directory's is a real write, which root fails in a mode
0555 directory too once it lacks CAP_DAC_OVERRIDE. What these checks cannot see is refused where
it happens: ports in use and sockets served by another daemon at bind (listeners.py), another
daemon's SSD directory at its lock (t2/directory_lock.py), a tokens or password file at load
(tenants.py, t3/remote_config.py).
"""

from __future__ import annotations

import grp
import os

from kvtierd.errors import FailedPrecondition, InvalidArgument
from kvtierd.planning.capacity import format_bytes
from kvtierd.server.config_flags import setting_name
from kvtierd.server.daemon_config import DaemonConfig
from kvtierd.server.listeners import MAX_UNIX_PATH_BYTES
from kvtierd.server.ssd_state import no_room_problem, off_by_choice
from kvtierd.t0.factory import resolve_device
from kvtierd.t2.ssd_probe import DirectoryProbe, UnusableDirectory, missing_directories, probe_directory
from kvtierd.t2.ssd_space import slot_files_bytes
from kvtierd.wire.fd_passing import FD_SOCKET_SUFFIX, fd_socket_path

SHM_DIRECTORY = "/dev/shm"  # where a CPU device pool (T0) lives


def check_machine(config: DaemonConfig) -> DirectoryProbe | None:
    """Raise InvalidArgument or FailedPrecondition for the first setting this machine cannot honour;
    the SSD directory's probe (None where T2 is off)."""
    server = config.server
    if server.socket:
        check_socket_path(server.socket)
        if server.socket_group:
            socket_group_id(server.socket_group)
    for key in ("tls_cert", "tls_key", "tls_client_ca"):
        if getattr(server, key):
            check_readable(getattr(server, key), f"server.{key}")
    ssd_probe = check_ssd(config)
    memory_bytes = machine_memory_bytes()
    if config.host.capacity_bytes > memory_bytes:
        raise FailedPrecondition(f"{setting_name('host.capacity_bytes')}: {format_bytes(config.host.capacity_bytes)} "
                                 f"is more than this machine's memory ({format_bytes(memory_bytes)})")
    if device_pool_in_shm(config.pool.device):
        shm_bytes = filesystem_size_bytes(SHM_DIRECTORY)
        if shm_bytes is not None and config.pool.t0_bytes > shm_bytes:
            raise FailedPrecondition(
                f"{setting_name('pool.t0_bytes')}: {format_bytes(config.pool.t0_bytes)} is more than "
                f"{SHM_DIRECTORY} holds ({format_bytes(shm_bytes)}), where the CPU device pool lives")
    return ssd_probe


def check_socket_path(path: str) -> None:
    setting = setting_name("server.socket")
    num_path_bytes = len(os.fsencode(path))
    if num_path_bytes > MAX_UNIX_PATH_BYTES:
        raise InvalidArgument(f"{setting}: {path} is {num_path_bytes} bytes long; a unix socket path holds at most "
                              f"{MAX_UNIX_PATH_BYTES}: choose a shorter one")
    if num_path_bytes + len(FD_SOCKET_SUFFIX) > MAX_UNIX_PATH_BYTES:
        raise InvalidArgument(f"{setting}: {path} is {num_path_bytes} bytes long; its fd socket "
                              f"{fd_socket_path(path)} must fit in {MAX_UNIX_PATH_BYTES}: choose a shorter one")
    check_creatable_directory(os.path.dirname(os.path.abspath(path)), setting)


def socket_group_id(group: str) -> int:
    """The gid of server.socket_group: a number as it is (a pod's supplementalGroups need no entry in
    /etc/group), a name looked up; FailedPrecondition for an unknown name."""
    if group.isdigit():
        return int(group)
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise FailedPrecondition(f"{setting_name('server.socket_group')}: no group {group!r} on this machine "
                                 "(getent group): create it, or give a group name that exists or a gid") from None


def check_readable(path: str, key: str) -> None:
    try:
        with open(path, "rb"):
            pass
    except OSError as e:
        raise InvalidArgument(f"{setting_name(key)}: cannot read {path}: {e.strerror}") from None


def check_ssd(config: DaemonConfig) -> DirectoryProbe | None:
    """The SSD directory probed where T2 is on, or wanted in a directory the operator named (then
    refused when a default budget found no room there); None where T2 is off."""
    ssd = config.ssd
    if not ssd.enabled and (off_by_choice(config) or "ssd.directory" not in config.given_keys):
        return None
    probe = check_ssd_directory(ssd.directory, ssd.capacity_bytes, ssd.o_direct)
    if not ssd.enabled:
        raise FailedPrecondition(f"{setting_name('ssd.directory')}: {no_room_problem(config)}")
    return probe


def check_ssd_directory(directory: str, capacity_bytes: int, o_direct: bool = True) -> DirectoryProbe:
    """Probe `directory` (t2/ssd_probe.py) and refuse it, or a filesystem without `capacity_bytes`
    free beside the slot files already there."""
    try:
        probe = probe_directory(directory, o_direct)
    except UnusableDirectory as e:
        raise FailedPrecondition(f"{setting_name('ssd.directory')}: {e}") from None
    free_bytes = probe.free_bytes
    slot_file_bytes = slot_files_bytes(directory)
    if free_bytes + slot_file_bytes < capacity_bytes:
        held = f" (and {format_bytes(slot_file_bytes)} in earlier slot files)" if slot_file_bytes else ""
        raise FailedPrecondition(
            f"{setting_name('ssd.capacity_bytes')}: {format_bytes(capacity_bytes)} does not fit in {directory}: "
            f"its filesystem has {format_bytes(free_bytes)} free{held}; the layouts' slot files may take all of it "
            "together")
    return probe


def check_creatable_directory(directory: str, setting: str) -> None:
    """Refuse a directory (an absolute path) that cannot be created or written, by os.access."""
    try:
        missing = missing_directories(directory)
    except UnusableDirectory as e:
        raise FailedPrecondition(f"{setting}: {e}") from None
    existing = os.path.dirname(missing[0]) if missing else directory
    if not os.access(existing, os.W_OK | os.X_OK):
        what = "it" if existing == directory else f"its ancestor {existing}"
        raise FailedPrecondition(f"{setting}: cannot write in the directory {directory}: {what} is not writable")


def machine_memory_bytes() -> int:
    """MemTotal from /proc/meminfo; physical pages times page size where there is none."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def filesystem_size_bytes(path: str) -> int | None:
    try:
        status = os.statvfs(path)
    except OSError:
        return None
    return status.f_blocks * status.f_frsize


def device_pool_in_shm(device: str) -> bool:
    """Whether pool.device resolves to the CPU (a /dev/shm pool), as the pool factory resolves it;
    a CUDA device this machine lacks is refused here."""
    try:
        kind, _ = resolve_device(device)
    except InvalidArgument:
        raise InvalidArgument(f"{setting_name('pool.device')}: this machine has no CUDA device {device!r}; "
                              "use auto or cpu") from None
    return kind == "shm"
