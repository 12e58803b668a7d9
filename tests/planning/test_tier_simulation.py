"""The tier simulator: what the engine's cache and kvtierd's tiers serve, by policy and hint."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvtierd.planning.request_trace import TraceRequest, write_trace
from kvtierd.planning.tier_simulation import SimTiers, TierSimulation
from kvtierd.tier import Tier

BLOCK = 4


def prompt(seed: int, num_blocks: int) -> tuple[int, ...]:
    """`num_blocks` full blocks of tokens of their own, and one more token (a lookup leaves the last
    token to compute, so every full block can hit)."""
    return tuple(seed * 1000 + i for i in range(num_blocks * BLOCK + 1))


def request(start_s: float, session: int, turn: int, tokens: tuple[int, ...], ttl_s: float = 0.0) -> TraceRequest:
    return TraceRequest(start_s, start_s + 0.5, session, turn, tokens, ttl_s)


def flood(start_s: float, num_prompts: int, num_blocks: int) -> list[TraceRequest]:
    """One-off prompts of other sessions, one a second."""
    return [request(start_s + i, 100 + i, 0, prompt(100 + i, num_blocks)) for i in range(num_prompts)]


def test_the_engine_alone_serves_what_its_cache_holds_and_kvtierd_what_it_evicted() -> None:
    """A 4-block history evicted from an 8-block engine cache by 3 flood prompts is a miss alone,
    and 4 T1 hits with kvtierd (T0 of 4 blocks spilled to T1)."""
    history = prompt(1, 4)
    trace = [request(0, 1, 0, history), *flood(1, 3, 4), request(10, 1, 1, history)]
    alone = TierSimulation(SimTiers(BLOCK, engine_blocks=8, kvtierd=False)).run(trace)
    kvtierd = TierSimulation(SimTiers(BLOCK, engine_blocks=8, t0_blocks=4, t1_blocks=64)).run(trace)
    assert alone.groups["resumed turns"].num_hit_tokens == 0
    assert kvtierd.groups["resumed turns"].num_hit_tokens == 4 * BLOCK
    assert kvtierd.tier_hit_tokens == {Tier.T0: 0, Tier.T1: 4 * BLOCK, Tier.T2: 0}
    assert kvtierd.num_unbounded_hit_tokens == 4 * BLOCK


def test_the_engine_serves_a_prefix_it_still_holds_before_kvtierd_is_asked() -> None:
    history = prompt(1, 4)
    trace = [request(0, 1, 0, history), request(2, 1, 1, history)]
    result = TierSimulation(SimTiers(BLOCK, engine_blocks=8, t0_blocks=4, t1_blocks=4)).run(trace)
    assert result.num_engine_hit_tokens == 4 * BLOCK and result.num_kvtierd_hit_tokens == 0


def test_a_history_longer_than_the_tiers_keeps_its_prefix_its_tail_leaves_first() -> None:
    """T0 4 + T1 2 blocks, no engine cache: a 10-block history stored tail first keeps its first 6
    blocks (T0 the first 4, T1 the next 2), all hits on the next turn; head first, its tail would
    stay and nothing would hit."""
    history = prompt(1, 10)
    trace = [request(0, 1, 0, history), request(10, 1, 1, history)]
    result = TierSimulation(SimTiers(BLOCK, engine_blocks=0, t0_blocks=4, t1_blocks=2)).run(trace)
    assert result.tier_hit_tokens == {Tier.T0: 4 * BLOCK, Tier.T1: 2 * BLOCK, Tier.T2: 0}


@pytest.mark.parametrize("eviction", ["lru", "s3fifo"])
def test_a_hinted_history_survives_a_flood_that_evicts_it_without_the_hint(eviction: str) -> None:
    """T0 4 + T1 8 blocks, no engine cache: 5 flood prompts of 4 blocks evict an unhinted history;
    a hint (TTL 60 s, the tenant may retain all of a tier) keeps it: the first flood block takes
    one of its T0 blocks (every block there is retained), which is demoted to T1."""
    history = prompt(1, 4)
    tiers = SimTiers(BLOCK, engine_blocks=0, t0_blocks=4, t1_blocks=8, eviction=eviction, max_tenant_share=1.0)
    unhinted = [request(0, 1, 0, history), *flood(1, 5, 4), request(20, 1, 1, history)]
    hinted = [request(0, 1, 0, history, ttl_s=60.0), *flood(1, 5, 4), request(20, 1, 1, history)]
    assert TierSimulation(tiers).run(unhinted).groups["resumed turns"].num_hit_tokens == 0
    result = TierSimulation(tiers).run(hinted)
    assert result.groups["resumed turns"].num_hit_tokens == 4 * BLOCK
    assert result.tier_hit_tokens == {Tier.T0: 3 * BLOCK, Tier.T1: BLOCK, Tier.T2: 0}
    assert result.num_demoted_blocks == 1
    no_hints = TierSimulation(SimTiers(BLOCK, 0, 4, 8, eviction=eviction, hints=False)).run(hinted)
    assert no_hints.groups["resumed turns"].num_hit_tokens == 0


def test_an_expired_hint_no_longer_protects() -> None:
    history = prompt(1, 4)
    trace = [request(0, 1, 0, history, ttl_s=2.0), *flood(5, 5, 4), request(20, 1, 1, history)]
    result = TierSimulation(SimTiers(BLOCK, 0, 4, 8, max_tenant_share=1.0)).run(trace)
    assert result.groups["resumed turns"].num_hit_tokens == 0


def test_s3fifo_keeps_a_block_used_twice_through_a_scan_that_lru_lets_go() -> None:
    """A shared 2-block prefix used by two sessions, then 9 one-off prompts through T0 of 8 blocks
    (T1 none, engine none): S3-FIFO serves the prefix to a third session, LRU does not."""
    shared = prompt(7, 2)
    trace = [request(0, 1, 0, shared), request(1, 2, 0, shared), *flood(2, 9, 1), request(20, 3, 0, shared)]
    lru = TierSimulation(SimTiers(BLOCK, 0, t0_blocks=8, t1_blocks=0)).run(trace)
    s3fifo = TierSimulation(SimTiers(BLOCK, 0, t0_blocks=8, t1_blocks=0, eviction="s3fifo")).run(trace)
    assert s3fifo.groups["all"].num_hit_tokens - lru.groups["all"].num_hit_tokens == 2 * BLOCK


def run_simulate(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvtierd.cli.kvtierd_main", "simulate", *args],
                          capture_output=True, text=True, timeout=300, check=False)


def test_simulate_agentic_compares_the_arms_at_equal_capacities() -> None:
    done = run_simulate("--agentic", "--sessions", "24", "--session-turns", "4", "--json")
    assert done.returncode == 0, done.stderr
    arms = json.loads(done.stdout)["arms"]
    assert set(arms) == {"alone", "lru", "s3fifo", "hints", "hints+s3fifo"}
    assert sum(arms["alone"]["tier_hit_tokens"].values()) == 0
    assert sum(arms["lru"]["tier_hit_tokens"].values()) > 0
    prompt_tokens = {arm["groups"]["all"]["num_prompt_tokens"] for arm in arms.values()}
    assert len(prompt_tokens) == 1, "every arm replays the same requests"
    assert arms["lru"]["groups"]["all"]["hit_rate"] > arms["alone"]["groups"]["all"]["hit_rate"]


def test_simulate_replays_a_trace_file(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    history = prompt(1, 4)
    write_trace(path, [request(0, 1, 0, history), *flood(1, 3, 4), request(10, 1, 1, history)])
    done = run_simulate("--trace", str(path), "--block-size", str(BLOCK), "--engine-blocks", "8",
                        "--t0-blocks", "4", "--t1-blocks", "64", "--arms", "alone,lru", "--json")
    assert done.returncode == 0, done.stderr
    arms = json.loads(done.stdout)["arms"]
    assert arms["lru"]["tier_hit_tokens"] == {"T0": 0, "T1": 16, "T2": 0}
    assert arms["alone"]["groups"]["resumed turns"]["num_hit_tokens"] == 0


@pytest.mark.parametrize("args, message", [
    (("--agentic", "--arms", "lru,fifo"), "unknown arm 'fifo'"),
    (("--agentic", "--max-tenant-share", "2"), "--max-tenant-share 2.0 is not in [0, 1]"),
])
def test_bad_simulate_arguments_are_one_line_and_exit_2(args: tuple[str, ...], message: str) -> None:
    done = run_simulate(*args)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip().splitlines() == [f"kvtierd: error: {message}"] or message in done.stderr


def test_a_malformed_trace_file_is_one_line_and_exit_2(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_text("not json\n")
    done = run_simulate("--trace", str(path))
    assert done.returncode == 2 and f"{path}:1: not a trace request" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_a_running_request_holds_engine_blocks_that_the_cache_then_lacks() -> None:
    """A 3-block history cached in a 6-block engine; a 4-block prompt that runs from 2 s to 10 s holds
    5 blocks meanwhile, so at 3 s only the history's first block is still cached (its tail went first);
    with kvtierd its other two blocks come from T0."""
    history, long_prompt = prompt(1, 3), prompt(2, 4)
    running = TraceRequest(2, 10, 2, 0, long_prompt, 0.0)
    during = TierSimulation(SimTiers(BLOCK, engine_blocks=6, kvtierd=False)).run(
        [request(0, 1, 0, history), running, request(3, 1, 1, history)])
    assert during.groups["resumed turns"].num_hit_tokens == 1 * BLOCK
    with_kvtierd = TierSimulation(SimTiers(BLOCK, engine_blocks=6, t0_blocks=8)).run(
        [request(0, 1, 0, history), running, request(3, 1, 1, history)])
    assert with_kvtierd.num_engine_hit_tokens == 1 * BLOCK and with_kvtierd.tier_hit_tokens[Tier.T0] == 2 * BLOCK
