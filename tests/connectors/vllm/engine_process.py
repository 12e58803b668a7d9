"""A real vLLM engine as a process tree of its own (the LLM process, its EngineCore and its workers),
started in a session of its own so that a timeout or a SIGKILL reaches all of them; its output
(vLLM's logs too) goes to `log_path`, its answer to `out_json`."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess

import pytest

from kvtierd.connectors.vllm.transfer_config import cpu_engine_env


def engine_env(**extra: str) -> dict[str, str]:
    """This environment for a test engine: no KVTIERD_* of the caller's, vLLM's CPU settings with a
    1 GiB KV cache, the connector's INFO lines in the engine's log, then `extra`."""
    env = cpu_engine_env({k: v for k, v in os.environ.items() if not k.startswith("KVTIERD_")}, kv_cache_gib=1)
    env["KVTIERD_LOG_LEVEL"] = "INFO"
    env.update(extra)
    return env


class EngineProcess:
    def __init__(self, command: list[str], directory: pathlib.Path, name: str, env: dict[str, str],
                 timeout_s: float = 300.0) -> None:
        self.name = name
        self.out_json = directory / f"{name}.json"
        self.log_path = directory / f"{name}.log"
        self.timeout_s = timeout_s
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=directory,
                                            env=env, start_new_session=True)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def failure_report(self) -> str:
        """The log from its first traceback (or its last 80 lines)."""
        lines = self.log().splitlines()
        first = next((i for i, line in enumerate(lines) if "Traceback (most recent call last)" in line
                      and "Tokenizer not available" not in "".join(lines[i:i + 15])), None)
        shown = lines[first:first + 120] if first is not None else lines[-80:]
        return f"engine {self.name} ({self.log_path}):\n" + "\n".join(shown)

    def kill(self) -> None:
        """SIGKILL the whole tree."""
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait(30)

    def result(self, timeout_s: float | None = None) -> dict:
        """Wait for the engine; fail the test with its traceback if it failed or ran too long."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        try:
            status = self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"engine {self.name} still ran after {timeout_s:.0f} s\n{self.failure_report()}")
        if status != 0 or not self.out_json.exists():
            pytest.fail(f"engine {self.name} exited with status {status}\n{self.failure_report()}")
        return json.loads(self.out_json.read_text())
