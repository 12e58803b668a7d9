"""Counts in the CLIs' human output agree with their nouns ("1 block", "2 blocks"), and inspect
names where a prompt's hits are without a negative or empty range."""

from __future__ import annotations

from kvtierd.cli.kvtierctl_plan import hit_ranges
from kvtierd.cli.kvtierctl_report import StatsView, health_problems
from kvtierd.cli.wording import plural
from kvtierd.v1 import kvtier_pb2 as pb


def test_plural_agrees_with_the_count():
    """One is singular; zero and more are plural, with thousands separated; an irregular plural is given."""
    assert [plural(n, "block") for n in (0, 1, 2, 1024)] == ["0 blocks", "1 block", "2 blocks", "1,024 blocks"]
    assert (plural(1, "miss", "misses"), plural(3, "miss", "misses")) == ("1 miss", "3 misses")


def stats_of_ones(num_sessions: int) -> pb.StatsResponse:
    """A Stats response where every count that can be one is one."""
    layout = pb.Layout(model_id="m", num_layers=2, num_kv_heads=2, head_dim=16, block_size=4, dtype="float16")
    pool = pb.PoolStats(layout=layout, num_blocks=2, num_free_blocks=1, num_corrupted_blocks=1, num_t2_io_errors=1,
                        num_failed_load_blocks=1, num_failed_offload_blocks=1, t2_admitting=True,
                        tiers=[pb.TierStats(tier="t0"), pb.TierStats(tier="t2")],
                        t3=pb.RemoteTierStats(codec="raw", num_hit_blocks=1, num_miss_blocks=1, num_corrupt_blocks=1))
    remote = pb.RemoteStoreStats(enabled=True, mode="cluster", breaker_state="open", num_nodes=1, num_open_nodes=1,
                                 num_errors=1, num_breaker_opens=1)
    return pb.StatsResponse(pools=[pool], num_sessions=num_sessions, num_reclaimed_refs=1, version="0.1.0",
                            remote=remote)


def test_stats_reads_a_count_of_one_as_one():
    """`kvtierctl stats`: every count of one in the header, the store line, the errors and T3 lines."""
    text = "\n".join(StatsView(stats_of_ones(num_sessions=1)).lines("unix:///k.sock"))
    for phrase in ("unix:///k.sock: 1 session, 1 block ref reclaimed from dead sessions",
                   "shared store (T3): cluster, 1 node, 1 UNREACHABLE, breakers open; 1 failed call, breakers "
                   "opened 1 time",
                   "errors: 1 corrupted T2 block dropped, 1 T2 I/O error, 1 failed load, 1 failed offload",
                   "1 hit block (0 B read), 1 miss, 1 refused value;"):
        assert phrase in text, phrase


def test_health_reads_a_count_of_one_as_one():
    """`kvtierctl health`: problems and notes with counts of one."""
    problems, notes = health_problems(stats_of_ones(num_sessions=0))
    assert problems == ["m: 1 T0 block held with no session open (a leak)",
                        "m: 1 corrupted T2 block dropped (disk or file damage)",
                        "m: 1 T2 I/O error",
                        "shared store (T3): 1 of 1 node unreachable"]
    assert notes[0] == "m: 1 failed load (recomputed), 1 failed offload"
    assert notes[1] == "shared store (T3): 1 failed call since start, breakers opened 1 time"
    assert notes[2].startswith("m: 1 T3 value refused by their check")
    assert notes[3].startswith("reclaimed 1 block ref from sessions that died")


def test_inspect_names_each_tiers_range_of_hits():
    """Hits in chain order, T0 first: one block is "block N"; a tier without hits is left out (no "0--1")."""
    assert hit_ranges(8, 0, 0, 0) == "blocks 0-7 in T0"
    assert hit_ranges(0, 1, 2, 0) == "block 0 in T1, then blocks 1-2 in T2"
    assert hit_ranges(1, 0, 0, 1) == "block 0 in T0, then block 1 in T3"


def test_a_sealed_tier_reports_its_unauthentic_blocks_in_stats_and_health():
    """With T2 sealed the errors line counts the blocks that did not open, and health calls them a problem;
    a tier in the clear keeps the line it had."""
    stats = stats_of_ones(num_sessions=1)
    pool = stats.pools[0]
    assert "unauthentic" not in "\n".join(StatsView(stats).lines("unix:///k.sock"))
    pool.t2_sealed, pool.num_unauthentic_blocks = True, 2
    assert "errors: 1 corrupted T2 block dropped, 2 unauthentic T2 blocks dropped, 1 T2 I/O error" in \
        "\n".join(StatsView(stats).lines("unix:///k.sock"))
    problems, _ = health_problems(stats)
    assert "m: 2 sealed T2 blocks did not open as their own and were dropped (moved or altered on disk?)" in problems
