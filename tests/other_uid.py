"""Accounts for tests that run a client under another uid than the daemon's (root's): a fresh group,
a user in it and a user outside it, created with groupadd/useradd for a module and removed after it.

The users have no home (useradd -M) and no login shell; runuser sets HOME to a directory that does
not exist, so a command that needs one is run as `as_user(user, home, ...)`. For the module, /root
gets o+x (search only: the interpreters live under /root/.pyenv), and its mode back afterwards,
even when a test fails."""

from __future__ import annotations

import os
import secrets
import shutil
import stat
import subprocess

import pytest

TOOLS = ("groupadd", "groupdel", "useradd", "userdel", "runuser")


def tool(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, timeout=60)


def as_user(user: str, home: str, command: list[str], trace: str | None = None) -> list[str]:
    """`command` as `user` with HOME=`home` (runuser would set a HOME that does not exist); with
    `trace`, under `strace -f` writing every open/openat/openat2 of the whole tree to that file."""
    wrapped = ["runuser", "-u", user, "--", "env", f"HOME={home}", *command]
    if trace is None:
        return wrapped
    return ["strace", "-f", "-qq", "--seccomp-bpf", "-e", "trace=open,openat,openat2", "-o", trace, *wrapped]


@pytest.fixture(scope="module")
def accounts():
    """A fresh group, a user in it and a user outside it: (group, inside, outside)."""
    if os.geteuid() != 0:
        pytest.skip("needs root: creates a group and users (groupadd/useradd) and runs as them (runuser)")
    missing = [name for name in TOOLS if shutil.which(name) is None]
    if missing:
        pytest.skip(f"needs {', '.join(missing)}")
    suffix = secrets.token_hex(3)
    group, inside, outside = f"kvt{suffix}", f"kvti{suffix}", f"kvto{suffix}"
    root_mode = stat.S_IMODE(os.stat("/root").st_mode)
    tool("groupadd", group)
    try:
        tool("useradd", "-M", "-N", "-s", "/usr/sbin/nologin", "-G", group, inside)
        tool("useradd", "-M", "-N", "-s", "/usr/sbin/nologin", outside)
        os.chmod("/root", root_mode | 0o001)  # search only: the interpreters live under /root
        yield group, inside, outside
    finally:
        os.chmod("/root", root_mode)
        for user in (inside, outside):
            subprocess.run(["userdel", user], capture_output=True, timeout=60)
        subprocess.run(["groupdel", group], capture_output=True, timeout=60)
