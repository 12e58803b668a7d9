"""`kvtierd serve` as a child process: started, waited for until ready, stopped.

For tests, benchmarks and demos that need a real daemon: it runs the same entry point an
operator runs, and reads the addresses it printed (a TCP port of 0 and a metrics port of 0 are
resolved that way).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

READY_LINE = "kvtierd: ready"
_LISTEN = re.compile(r"^kvtierd: listening on (\S+)$")
_METRICS = re.compile(r"^kvtierd: metrics on (\S+)$")
_HEALTH = re.compile(r"^kvtierd: health checks on (\S+)$")


class DaemonProcess:
    """A running `kvtierd serve`. `unix_address` / `tcp_address` / `metrics_url` as printed."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None, ready_timeout_s: float = 60.0) -> None:
        self.args = args
        self.lines: list[str] = []
        self.unix_address: str | None = None
        self.tcp_address: str | None = None
        self.metrics_url: str | None = None
        self.health_address: str | None = None  # host:port of server.health_tcp
        child_env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIERD_")}
        child_env.update(env or {})
        self.process = subprocess.Popen([sys.executable, "-m", "kvtierd.cli", "serve", *args], env=child_env,
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
        self._ready = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        if not self._ready.wait(ready_timeout_s) or self.process.poll() is not None:
            self.kill()
            raise RuntimeError("kvtierd serve did not become ready:\n" + self.output())

    def _read(self) -> None:
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
            elif line == READY_LINE:
                self._ready.set()
        self._ready.set()  # exited: wake a waiter

    @property
    def address(self) -> str:
        return self.unix_address or self.tcp_address

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

    def __exit__(self, *exc_info) -> None:
        self.stop()
        self.kill()


def small_daemon_args(directory: str, *, t0_bytes: str = "4MiB", host_bytes: str = "8MiB",
                      ssd_bytes: str = "16MiB", extra: list[str] | None = None) -> list[str]:
    """Arguments for a daemon whose sockets, SSD files and metrics stay inside `directory`."""
    return ["--socket", os.path.join(directory, "kvtierd.sock"), "--ssd-dir", os.path.join(directory, "ssd"),
            "--metrics-port", "0", "--t0-bytes", t0_bytes, "--host-bytes", host_bytes, "--ssd-bytes", ssd_bytes,
            *(extra or [])]


def wait_until(predicate, timeout_s: float = 10.0, period_s: float = 0.05) -> bool:
    """Poll `predicate` until it is true or the time runs out; returns its last value."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return bool(value)
        time.sleep(period_s)

