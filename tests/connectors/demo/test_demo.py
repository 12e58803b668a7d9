"""`kvtierd demo` end to end, as the README runs it (scaled down): every tier serves hits, every
turn generates the same tokens with and without kvtierd, and nothing leaks."""

from __future__ import annotations

import json
import subprocess

import pytest

from kvtierd.launch.daemon_process import DaemonProcess, python_module_command, small_daemon_args

SMALL = ["--random-weights", "--layers", "2", "--hidden", "128", "--conversations", "3", "--turns", "3",
         "--shared-requests", "2", "--system-prompt-tokens", "256", "--first-turn-tokens", "128", "--reply-tokens", "8",
         "--t0-blocks", "24", "--t1-blocks", "24"]


def run_demo(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(python_module_command("kvtierd.cli.kvtierd_main", "demo", *args), capture_output=True,
                          text=True, timeout=600)


@pytest.mark.slow  # a demo run, seconds each
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
        assert t["num_computed_tokens"] == t["num_prompt_tokens"] - sum(t[f"num_{x}_hit_tokens"]
                                                                        for x in ("t0", "t1", "t2"))
    assert report["num_leaked_blocks"] == 0
    tiers = {t["tier"]: t for t in report["tiers"]}
    assert tiers["t1"]["num_evictions"] > 0 and tiers["t0"]["num_evictions"] > 0


@pytest.mark.slow  # a demo run, seconds each
def test_demo_prints_a_table_per_turn_and_the_tier_stats():
    done = run_demo(*SMALL, "--turns", "1", "--conversations", "1")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[1].split()[:3] == ["phase", "turn", "prompt"]
    rows = [line for line in lines if line.startswith(("shared", "chat"))]
    assert len(rows) == 5 and all(row.endswith("yes") for row in rows)
    assert any(line.startswith("t2 ") for line in lines)
    assert "generations identical: 5 of 5" in done.stdout


@pytest.mark.slow  # a demo run, seconds each
def test_demo_uses_a_running_daemon_with_address(tmp_path):
    with DaemonProcess(small_daemon_args(str(tmp_path), t0_bytes="2MiB")) as daemon:
        done = run_demo(*SMALL, "--turns", "1", "--conversations", "1", "--address", daemon.address, "--json")
        assert done.returncode == 0, done.stderr
        report = json.loads(done.stdout)
        assert report["daemon"] == daemon.address
        assert report["turns"][1]["num_t0_hit_tokens"] == 256


@pytest.mark.slow  # a demo run, seconds each
def test_demo_refuses_conflicting_model_flags_and_a_down_daemon_clearly(tmp_path):
    done = run_demo("--random-weights", "--model", str(tmp_path / "m.gguf"))
    assert done.returncode == 2 and done.stderr.strip() == ("kvtierd: error: --model and --random-weights "
                                                            "exclude each other")
    done = run_demo("--model", str(tmp_path / "missing.gguf"))
    assert done.returncode == 2 and "is neither a .gguf file nor a model directory" in done.stderr
    assert "Traceback" not in done.stderr
    done = run_demo(*SMALL, "--address", f"unix://{tmp_path}/nobody.sock")
    assert done.returncode == 2
    assert "Traceback" not in done.stderr and "nobody.sock" in done.stderr


def test_demo_on_smollm2_replies_in_text_identically_with_and_without_kvtierd(smollm2_gguf):
    """The default model, fetched once: real replies, the same tokens both ways, the system prompt
    and the conversation's own history restored."""
    done = run_demo("--shared-requests", "2", "--conversations", "1", "--turns", "2", "--reply-tokens", "8", "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["model"].startswith("SmolLM2-135M-Instruct.Q4_1 (GGUF): 30 layers, hidden 576")
    turns = report["turns"]
    assert [t["label"] for t in turns] == ["question 1", "question 2", "conv 1 turn 1", "conv 1 turn 2",
                                           "question 3", "question 4"]
    assert all(t["same_output"] for t in turns)
    assert all(any(ch.isalpha() for ch in t["reply"]) for t in turns), [t["reply"] for t in turns]
    assert turns[0]["num_computed_tokens"] == turns[0]["num_prompt_tokens"] > 1000  # cold: the whole handbook
    assert turns[1]["num_t0_hit_tokens"] >= 1024
    first, second = turns[2], turns[3]  # the second turn's prompt extends the first's
    hits = second["num_prompt_tokens"] - second["num_computed_tokens"]
    assert hits >= first["num_prompt_tokens"] // 16 * 16
    assert report["num_leaked_blocks"] == 0
