"""A real `vllm serve` (vLLM's OpenAI-compatible server: API server, engine core and worker
processes) started through `kvtierd-vllm` in .venv-vllm, in a session of its own so that a stop or a
timeout reaches every process of it, and the HTTP calls a user's client makes: /health,
/v1/completions, /metrics."""

from __future__ import annotations

import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request

from kvtierd.connectors.vllm.transfer_config import kv_transfer_config
from tests.connectors.vllm.engine_process import engine_env

SERVED_NAME = "model"
# Three processes importing vLLM and torch on 2 busy cores: 40-170 s seen eager; torch.compile's first
# warm-up (an empty compile cache, as on a CI machine) adds 150-300 s, so tests serve eager.
START_TIMEOUT_S = 600.0


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class ServerFailed(AssertionError):
    """The server died or never became ready; the message holds the end of its log."""


class OpenAIServer:
    """`kvtierd-vllm serve MODEL` on a free port; with `address`, through KvtierdConnector to that daemon.
    `eager` serves without torch.compile (--enforce-eager: the same tokens, a third of the start-up
    time); the benchmarks serve compiled, as a user's `vllm serve` does by default.

    Invariant: `url` answers only between `wait_ready()` and `stop()`.
    """

    def __init__(self, vllm_python: str, model: pathlib.Path, log_path: pathlib.Path, *, address: str | None,
                 block_size: int = 32, max_model_len: int = 2048, extra_args: tuple[str, ...] = (),
                 eager: bool = True, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.launcher = str(pathlib.Path(vllm_python).with_name("kvtierd-vllm"))
        command = [self.launcher, "serve", str(model), "--served-model-name", SERVED_NAME, "--host", "127.0.0.1",
                   "--port", str(self.port), "--block-size", str(block_size), "--max-model-len", str(max_model_len),
                   "--dtype", "bfloat16", *(("--enforce-eager",) if eager else ()), *extra_args]
        if address is not None:
            command += ["--kv-transfer-config", json.dumps(kv_transfer_config(address))]
        with open(log_path, "w") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                            env=env or engine_env(), start_new_session=True)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_tail(self, num_lines: int = 60) -> str:
        return f"vllm serve ({self.log_path}):\n" + "\n".join(self.log().splitlines()[-num_lines:])

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> OpenAIServer:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ServerFailed(f"vllm serve exited with {self.process.returncode}\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as reply:
                    if reply.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        raise ServerFailed(f"vllm serve was not ready after {timeout_s:.0f} s\n{self.log_tail()}")

    def complete(self, prompt: str, max_tokens: int = 16, timeout_s: float = 300.0) -> str:
        """A greedy completion's text (temperature 0, no stop but the length)."""
        body = json.dumps({"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                           "ignore_eos": True}).encode()
        request = urllib.request.Request(self.url + "/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=timeout_s) as reply:
            answer = json.load(reply)
        return answer["choices"][0]["text"]

    def metrics(self) -> dict[str, float]:
        """vLLM's /metrics samples as {'name{labels}': value}, labels as vLLM prints them."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as reply:
            text = reply.read().decode()
        samples = {}
        for line in text.splitlines():
            found = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*(?:\{[^}]*\})?) ([-+0-9.eE]+|NaN|[+-]Inf)$", line)
            if found:
                samples[found.group(1)] = float(found.group(2))
        return samples

    def metric_sum(self, name: str, **labels: str) -> float:
        """The sum of `name`'s samples whose labels include `labels` (e.g. source="disk")."""
        wanted = [f'{key}="{value}"' for key, value in labels.items()]
        return sum(value for sample, value in self.metrics().items()
                   if sample.split("{")[0] == name and all(label in sample for label in wanted))

    def stop(self, timeout_s: float = 60.0) -> None:
        """SIGTERM to every process of the server; after `timeout_s`, or once it exited, SIGKILL to what is left."""
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait(30)

    def __enter__(self) -> OpenAIServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
