"""Shared by the benchmarks: a paired timing loop, statistics, and a plain-text table.

Every benchmark times our operation and its baseline in the same process, round by round in
alternation (ours, baseline, ours, baseline, ...), so that a noisy neighbour on a shared machine
slows both sides alike. Absolute times are noise on such a machine; the ratio is the result.

Timing: `time.perf_counter_ns` around one round; untimed setup before each round of ours puts the
state back where it started; warm-up rounds are run and thrown away; the garbage collector is
off while rounds run (our side allocates lists and objects, the baseline almost nothing, so a
collection would land on our side by chance) and a full collection runs before the first round.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

Op = Callable[[], object]

# Where print_table also appends each table as one JSON line (title, headers, rows), when set:
# scripts/gpu-acceptance reads the benchmarks' tables from there.
TABLES_ENV = "KVTIERD_BENCH_TABLES"
_title = ""  # the last print_header's title, for the JSON line

TIMING_NOTE = ("timing: time.perf_counter_ns per round, ours and baseline alternating; "
               "warm-up rounds discarded; gc disabled while timing; median over rounds (best in brackets)")


@dataclasses.dataclass(slots=True)
class Timings:
    """Nanoseconds per round, one entry per timed round."""

    round_ns: list[int]

    @property
    def median_ns(self) -> float:
        return statistics.median(self.round_ns)

    @property
    def best_ns(self) -> float:
        return min(self.round_ns)


def time_interleaved(ops: Sequence[Op], *, rounds: int, warmup: int, setup: Op | None = None) -> list[Timings]:
    """Time each of `ops` once per round, in turn, for `rounds` rounds after `warmup` untimed ones.

    `setup` runs untimed at the start of every round (warm-up included) and once after the last:
    it restores the starting state and may assert that the previous round did what it should.
    """
    clock = time.perf_counter_ns
    for _ in range(warmup):
        if setup is not None:
            setup()
        for op in ops:
            op()
    round_ns: list[list[int]] = [[] for _ in ops]
    gc.collect()
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for _ in range(rounds):
            if setup is not None:
                setup()
            for op, samples in zip(ops, round_ns):
                start = clock()
                op()
                samples.append(clock() - start)
        if setup is not None:
            setup()  # checks the last timed round
    finally:
        if gc_was_enabled:
            gc.enable()
    return [Timings(samples) for samples in round_ns]


def time_pair(ours: Op, baseline: Op, *, rounds: int, warmup: int,
              ours_setup: Op | None = None) -> tuple[Timings, Timings]:
    """Time `ours` and `baseline` alternately; `ours_setup` runs untimed before every round."""
    ours_timings, baseline_timings = time_interleaved(
        [ours, baseline], rounds=rounds, warmup=warmup, setup=ours_setup)
    return ours_timings, baseline_timings


def argument_parser(description: str) -> argparse.ArgumentParser:
    """The flags every benchmark takes (--quick); a benchmark may add its own."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help="a few rounds only (smoke test); numbers are rough")
    return parser


def parse_args(description: str, argv: Sequence[str] | None = None) -> argparse.Namespace:
    return argument_parser(description).parse_args(argv)


def print_header(title: str, quick: bool, timing_note: str = TIMING_NOTE) -> None:
    global _title
    _title = title
    print(title)
    print(f"python {platform.python_version()} ({platform.python_implementation()}), {platform.machine()}, "
          f"{'QUICK run: rough numbers' if quick else 'full run'}")
    print(timing_note)


def print_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    """A plain-text table: the first column left-aligned, the others right-aligned."""
    cells = [[str(cell) for cell in row] for row in [headers, *rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]

    def line(row: list[str]) -> str:
        return "  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))

    print(line(cells[0]))
    print("  ".join("-" * w for w in widths))
    for row in cells[1:]:
        print(line(row))
    sys.stdout.flush()
    if path := os.environ.get(TABLES_ENV):
        with open(path, "a") as tables:
            tables.write(json.dumps({"title": _title, "headers": cells[0], "rows": cells[1:]}) + "\n")


def verdict(passed: bool) -> str:
    return "PASS" if passed else "MISS"


def print_goals(goals: Sequence[tuple[str, bool]]) -> None:
    """One line per goal, its text (the figure and the target in it) and then its verdict, last on the
    line as in every benchmark's table."""
    print_table(["goal", "verdict"], [[text, verdict(passed)] for text, passed in goals])


def median_and_best(median: float, best: float, digits: int = 0) -> str:
    """`median (best)`, e.g. `812 (790)`."""
    return f"{median:,.{digits}f} ({best:,.{digits}f})"


def stop_process(process: subprocess.Popen, timeout_s: float = 10.0) -> None:
    """SIGTERM a baseline server, SIGKILL it if it does not exit in time."""
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout_s)
