"""The README's `vllm serve` quick start, run as written: the block after the
`<!-- vllm-serve-quickstart -->` marker, by bash, from the repository's root.

It builds .venv-vllm, starts `kvtierd serve` on its default socket, fetches SmolLM2 as a Hugging
Face directory, serves it with `kvtierd-vllm serve` (vLLM's OpenAI server on the CPU build) and the
connector, asks once, restarts the server and asks again. Checked from what it prints: both replies
are the same non-empty text, kvtierctl saw blocks in T0, and vLLM's own
`vllm:external_prefix_cache_hits_total` of the second server counts whole blocks loaded from
kvtierd. The only change to the environment is a private XDG_RUNTIME_DIR (the daemon's default
socket goes there) and, first, the check that the quick start's port is free.
"""

from __future__ import annotations

import os
import pathlib
import re
import signal
import socket
import subprocess

import pytest

REPO = pathlib.Path(__file__).resolve().parents[3]
MARKER = "<!-- vllm-serve-quickstart -->"
PORT = 8000
BLOCK_SIZE = 32
TIMEOUT_S = 1500  # the venv exists (vllm_python); two server starts of ~40-170 s on 2 cores


def quickstart_block() -> str:
    text = (REPO / "README.md").read_text()
    assert MARKER in text, "the README lost its vLLM serve quick start"
    after = text[text.index(MARKER) + len(MARKER):].lstrip("\n")
    assert after.startswith("```bash\n"), "the quick start's marker must precede its ```bash block"
    return after[len("```bash\n"):after.index("\n```")]


def port_is_free(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) != 0


@pytest.mark.vllm
@pytest.mark.weights
def test_the_readme_quickstart_serves_and_a_new_server_loads_the_prefix_from_kvtierd(vllm_python, tmp_path):
    block = quickstart_block()
    assert "kvtierd-vllm serve" in block and "kvtierctl stats" in block
    if not port_is_free(PORT):
        pytest.fail(f"port {PORT}, the quick start's, is taken on this machine")
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    env = {name: value for name, value in os.environ.items() if not name.startswith("KVTIERD_")}
    env["XDG_RUNTIME_DIR"] = str(run_dir)
    shell = subprocess.Popen(["bash", "-c", block], cwd=REPO, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = shell.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(shell.pid, signal.SIGKILL)
        output, _ = shell.communicate()
        pytest.fail(f"the quick start did not finish in {TIMEOUT_S} s:\n{output[-6000:]}")
    finally:
        try:
            os.killpg(shell.pid, signal.SIGKILL)  # whatever it left running
        except ProcessLookupError:
            pass
    tail = output[-6000:]
    assert shell.returncode == 0, tail

    replies = re.findall(r'^reply: (".*")$', output, re.MULTILINE)
    assert len(replies) == 2, tail
    assert replies[0] == replies[1] and len(replies[0]) > 2, replies

    t0_rows = re.findall(r"^\s+t0\s+\S+ \S+\s+\S+ \S+\s+(\d+)\s", output, re.MULTILINE)
    assert t0_rows and int(t0_rows[0]) > 0, tail  # kvtierctl stats: cached blocks in T0

    hits = re.findall(r"^vllm:external_prefix_cache_hits_total\{.*\} ([0-9.e+]+)$", output, re.MULTILINE)
    assert len(hits) == 1, tail
    hit_tokens = float(hits[0])
    assert hit_tokens > 0 and hit_tokens % BLOCK_SIZE == 0, hits
    assert hit_tokens >= BLOCK_SIZE * int(t0_rows[0]) - BLOCK_SIZE, (hits, t0_rows)
