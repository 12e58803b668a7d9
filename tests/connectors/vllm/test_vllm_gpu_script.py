"""scripts/run-vllm-gpu parses and explains itself here; it runs vLLM only on a GPU machine."""

from __future__ import annotations

import os
import subprocess
import sys

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "..", "scripts", "run-vllm-gpu")


def test_the_gpu_script_compiles_and_is_executable():
    with open(SCRIPT) as script:
        compile(script.read(), SCRIPT, "exec")  # a SyntaxError fails the test
    assert os.access(SCRIPT, os.X_OK)


def test_the_gpu_script_shows_help_without_vllm():
    done = subprocess.run([sys.executable, SCRIPT, "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    for option in ("--model", "--load-format", "--kvtierd-address", "--kv-cache-layout"):
        assert option in done.stdout
    assert "KvtierdConnector" not in done.stderr and "warm" in done.stdout
