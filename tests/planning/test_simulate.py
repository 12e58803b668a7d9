"""The simulated chat workload: hits, evictions, verification and the `kvtierd simulate` command."""

from __future__ import annotations

import json
import subprocess

import pytest

from kvtierd.cli.kvtierd_main import main
from kvtierd.errors import InvalidArgument
from kvtierd.launch.daemon_process import python_module_command
from kvtierd.planning.chat_workload import ChatWorkload, Conversations
from kvtierd.planning.simulate import ChatSimulator, report_lines

SMALL = ChatWorkload(num_conversations=6, num_turns=3, system_prompt_tokens=256, seed=3)


def run(workload: ChatWorkload, num_pool_blocks: int):
    simulator = ChatSimulator(workload, num_pool_blocks)
    try:
        return simulator.run()
    finally:
        simulator.close()


def test_conversations_grow_their_history():
    conversations = Conversations(SMALL)
    first = next(conversations.first_turns())
    second = conversations.next_turn(first, now_s=100.0)
    assert second.prompt[:len(first.prompt)] == first.prompt
    assert second.prompt[len(first.prompt):len(first.prompt) + len(first.replies[0])] == first.replies[0]
    assert second.arrival_s >= 100.0 + SMALL.think_time_s[0]
    assert first.prompt[:256] == conversations.system_prompt


def test_under_pressure_hits_are_verified_and_nothing_leaks():
    report = run(SMALL, num_pool_blocks=96)
    assert report.num_evictions > 0
    assert report.num_verified_hit_blocks > 0 and report.num_mismatched_hit_blocks == 0
    assert 16 * report.num_verified_hit_blocks >= report.num_hit_tokens > 0  # re-runs verify again
    assert report.num_free_blocks_after == 96
    # Every conversation after the first finds the system prompt (256 tokens) cached on turn 1.
    assert report.per_turn[0].num_hit_tokens >= 256 * (SMALL.num_conversations - 2)


def test_a_larger_pool_evicts_less_and_hits_more():
    small, large = run(SMALL, 96), run(SMALL, 1024)
    assert large.num_evictions == 0 < small.num_evictions
    assert large.num_hit_tokens > small.num_hit_tokens
    assert large.num_prompt_tokens == small.num_prompt_tokens  # same seed, same prompts


def test_forked_samples_copy_on_write():
    report = run(ChatWorkload(num_conversations=4, num_turns=2, system_prompt_tokens=64, fork_fraction=1.0), 256)
    assert report.num_copy_on_write > 0 and report.num_mismatched_hit_blocks == 0


def test_corrupted_pool_bytes_are_caught_as_mismatches():
    simulator = ChatSimulator(SMALL, 1024)
    try:
        simulator.run()
        simulator.pool.tensor.add_(1)  # every cached block now holds other bytes
        report = simulator.run()
    finally:
        simulator.close()
    assert report.num_mismatched_hit_blocks > 0


def test_a_pool_too_small_for_one_request_is_a_clear_error():
    with pytest.raises(InvalidArgument, match="raise --pool-blocks"):
        run(SMALL, num_pool_blocks=8)


def test_report_lines_carry_capacity_hit_rate_and_evictions():
    text = "\n".join(report_lines(run(SMALL, 96)))
    for needle in ("KV bytes per token: 4,096", "maximum concurrency for", "per allocated slot",
                   "per effective token", "prefix hit rate:", "evictions:", "0 mismatched", "reuse gap p90"):
        assert needle in text


def test_cli_json(capsys):
    assert main(["simulate", "--conversations", "3", "--turns", "2", "--system-prompt-tokens", "64",
                 "--pool-blocks", "128", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["num_mismatched_hit_blocks"] == 0 and report["num_free_blocks_after"] == 128
    assert 0 < report["num_hit_tokens"] < report["num_prompt_tokens"]


def test_cli_errors_are_readable(capsys):
    assert main(["simulate", "--pool-blocks", "4"]) == 2
    assert "raise --pool-blocks" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["simulate", "--turns", "0"])
    assert exit_info.value.code == 2


def test_module_runs_as_a_command():
    out = subprocess.run([*python_module_command("kvtierd.cli.kvtierd_main", "simulate"), "--conversations", "2",
                          "--turns", "2", "--system-prompt-tokens", "32", "--pool-blocks", "64"],
                         capture_output=True, text=True, check=True).stdout
    assert "prefix hit rate:" in out and "free blocks after all requests finished: 64 of 64" in out


def test_the_kvtierd_console_script_is_installed():
    """The README's first command calls `kvtierd simulate`: the entry point must exist."""
    from importlib.metadata import entry_points

    scripts = {ep.name: ep.value for ep in entry_points(group="console_scripts")}
    assert scripts.get("kvtierd") == "kvtierd.cli.kvtierd_main:main"
