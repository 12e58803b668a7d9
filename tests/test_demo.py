"""`kvtierd demo` end to end, as the README runs it (scaled down): every tier serves hits, every
turn generates the same tokens with and without kvtierd, and nothing leaks."""

from __future__ import annotations

import json
import subprocess
import sys

from kvtierd.daemon_process import DaemonProcess, small_daemon_args

SMALL = ["--layers", "2", "--hidden", "128", "--conversations", "3", "--turns", "3", "--shared-requests", "2",
         "--system-prompt-tokens", "256", "--first-turn-tokens", "128", "--reply-tokens", "8",
         "--t0-blocks", "24", "--t1-blocks", "24"]


def run_demo(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvtierd.cli", "demo", *args], capture_output=True, text=True,
                          timeout=300)


def test_demo_serves_hits_from_every_tier_and_matches_recompute():
    done = run_demo(*SMALL, "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    turns = report["turns"]
    assert len(turns) == 2 + 9 + 2
    assert all(t["same_output"] for t in turns)
    for tier in ("t0", "t1", "t2"):
        assert sum(t[f"num_{tier}_hit_tokens"] for t in turns) > 0, tier
    first = turns[0]
    assert first["num_computed_tokens"] == first["num_prompt_tokens"] == 256 + 48  # cold
    assert turns[1]["num_t0_hit_tokens"] == 256  # the shared system prompt
    for t in turns:  # what was not restored was computed
        assert t["num_computed_tokens"] == t["num_prompt_tokens"] - sum(t[f"num_{x}_hit_tokens"] for x in ("t0", "t1", "t2"))
    assert report["num_leaked_blocks"] == 0
    tiers = {t["tier"]: t for t in report["tiers"]}
    assert tiers["t1"]["num_evictions"] > 0 and tiers["t0"]["num_evictions"] > 0


def test_demo_prints_a_table_per_turn_and_the_tier_stats():
    done = run_demo(*SMALL, "--turns", "1", "--conversations", "1")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[1].split()[:3] == ["phase", "turn", "prompt"]
    rows = [line for line in lines if line.startswith(("shared", "chat"))]
    assert len(rows) == 5 and all(row.endswith("yes") for row in rows)
    assert any(line.startswith("t2 ") for line in lines)
    assert "generations identical: 5 of 5" in done.stdout


def test_demo_uses_a_running_daemon_with_address(tmp_path):
    with DaemonProcess(small_daemon_args(str(tmp_path), t0_bytes="2MiB")) as daemon:
        done = run_demo(*SMALL, "--turns", "1", "--conversations", "1", "--address", daemon.address, "--json")
        assert done.returncode == 0, done.stderr
        report = json.loads(done.stdout)
        assert report["daemon"] == daemon.address
        assert report["turns"][1]["num_t0_hit_tokens"] == 256


def test_demo_refuses_weights_without_a_config_and_a_down_daemon_clearly(tmp_path):
    done = run_demo("--weights", str(tmp_path / "w.safetensors"))
    assert done.returncode == 2 and "--weights needs --config" in done.stderr
    done = run_demo(*SMALL, "--address", f"unix://{tmp_path}/nobody.sock")
    assert done.returncode == 2
    assert "Traceback" not in done.stderr and "nobody.sock" in done.stderr
