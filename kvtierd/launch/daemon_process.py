"""`kvtierd serve` as a child process: started, waited for until ready, stopped.

For tests, benchmarks and demos that need a real daemon: it runs the same entry point an
operator runs, and reads the addresses it printed (a TCP port of 0 and a metrics port of 0 are
resolved that way). A child that dies before it is ready is reported with its exit status and
its output, never as a later dial error.

Python children start with `-P` (python_module_command): the working directory is not put on
sys.path, so a checkout in the current directory cannot shadow the installed package.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvtierd.errors import Unavailable
from kvtierd.tier import Tier

if TYPE_CHECKING:
    from kvtierd.client.sync_client import KvtierClient

READY_LINE = "kvtierd: ready"
_LISTEN = re.compile(r"^kvtierd: listening on (\S+)$")
_METRICS = re.compile(r"^kvtierd: metrics on (\S+)$")
_HEALTH = re.compile(r"^kvtierd: health checks on (\S+)$")
_KV_EVENTS = re.compile(r"^kvtierd: kv events on (\S+)$")
_KV_REPLAY = re.compile(r"^kvtierd: kv event replay on (\S+)$")


def python_module_command(module: str, *args: str) -> list[str]:
    """`python -P -m module args`: this interpreter, the working directory kept off sys.path."""
    return [sys.executable, "-P", "-m", module, *args]


class DaemonStartError(Unavailable):
    """`kvtierd serve` exited, or never said it was ready; the message holds its status and output."""


class DaemonProcess:
    """A running `kvtierd serve`. `unix_address` / `tcp_address` / `metrics_url` as printed.
`module` is the entry point run with `serve` (a test may wrap kvtierd_main to inject faults).

    `_settled` is set once: on the ready line, or when the child's output closes (it exited);
    `ready` says which.
    """

    def __init__(self, args: list[str], env: dict[str, str] | None = None, ready_timeout_s: float = 60.0,
                 module: str = "kvtierd.cli.kvtierd_main") -> None:
        self.args = args
        self.lines: list[str] = []
        self.unix_address: str | None = None
        self.tcp_address: str | None = None
        self.metrics_url: str | None = None
        self.health_address: str | None = None  # host:port of server.health_tcp
        self.kv_events_address: str | None = None  # the ZMQ PUB endpoint of [events], as bound
        self.kv_replay_address: str | None = None  # its replay ROUTER endpoint
        child_env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIERD_")}
        child_env.update(env or {})
        self.process = subprocess.Popen(python_module_command(module, "serve", *args), env=child_env,
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
        self.ready = False
        self._settled = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        if not self._settled.wait(ready_timeout_s):
            self.kill()
            self._reader.join(5)
            raise DaemonStartError(f"kvtierd serve did not become ready within {ready_timeout_s:.0f} s:\n"
                                   + self.output())
        if not self.ready:
            try:
                status = self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()
                status = self.process.returncode
            self._reader.join(5)
            raise DaemonStartError(f"kvtierd serve exited with status {status} before it was ready:\n"
                                   + self.output())

    def _read(self) -> None:
        assert self.process.stdout is not None, "started with stdout=PIPE"
        for line in self.process.stdout:
            line = line.rstrip("\n")
            self.lines.append(line)
            if match := _LISTEN.match(line):
                address = match.group(1)
                if address.startswith("unix://"):
                    self.unix_address = address
                else:
                    self.tcp_address = address
            elif match := _METRICS.match(line):
                self.metrics_url = match.group(1)
            elif match := _HEALTH.match(line):
                self.health_address = match.group(1)
            elif match := _KV_EVENTS.match(line):
                self.kv_events_address = match.group(1)
            elif match := _KV_REPLAY.match(line):
                self.kv_replay_address = match.group(1)
            elif line == READY_LINE:
                self.ready = True
                self._settled.set()
        self._settled.set()  # the output closed: the child exited

    @property
    def address(self) -> str:
        """Where it serves (its unix socket, else TCP), once started."""
        address = self.unix_address or self.tcp_address
        assert address is not None, "the daemon printed no address: it is not started"
        return address

    @property
    def pid(self) -> int:
        return self.process.pid

    def output(self) -> str:
        return "\n".join(self.lines)

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 60.0) -> int:
        """Send `sig` and wait; returns the exit status."""
        if self.process.poll() is None:
            self.process.send_signal(sig)
        try:
            return self.process.wait(timeout_s)
        finally:
            self._reader.join(5)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)

    def __enter__(self) -> DaemonProcess:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
        self.kill()


# Flags that send every committed block down T0 -> T1 -> T2 at once, so that a restart keeps it.
WRITE_THROUGH = ["--set", "policy.t0_to_t1=write_through", "--set", "policy.t1_to_t2=write_through"]
ONE_LAYOUT = ["--set", "pool.max_layouts=1"]  # a daemon for one layout (which then holds the whole host budget)


def written_through(client: KvtierClient) -> bool:
    """True once every pool of the daemon `client` talks to caches blocks in T0 and T2 holds as
    many (write-through copies them in the background)."""
    pools = client.stats().pools
    return bool(pools) and all(0 < tiers[Tier.T0].num_cached_blocks <= tiers[Tier.T2].num_cached_blocks
                               for tiers in ({t.tier: t for t in pool.tiers} for pool in pools))


def small_daemon_args(directory: str, *, t0_bytes: str = "4MiB", host_bytes: str = "8MiB",
                      ssd_bytes: str = "16MiB", extra: list[str] | None = None) -> list[str]:
    """Arguments for a daemon whose sockets, SSD files and metrics stay inside `directory`."""
    return ["--socket", os.path.join(directory, "kvtierd.sock"), "--ssd-dir", os.path.join(directory, "ssd"),
            "--metrics-port", "0", "--t0-bytes", t0_bytes, "--host-bytes", host_bytes, "--ssd-bytes", ssd_bytes,
            *(extra or [])]


def wait_until(predicate: Callable[[], object], timeout_s: float = 10.0, period_s: float = 0.05) -> bool:
    """Poll `predicate` until it is true or the time runs out; returns its last value."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return bool(value)
        time.sleep(period_s)

