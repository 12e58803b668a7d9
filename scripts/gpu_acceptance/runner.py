"""The run on the GPU machine: install what travelled, then each part as a subprocess.

Each part gets its own process group and time limit, the smaller of its cap and what is left of
the run's budget; on the limit the whole group (the daemons a test started included) is killed
and the run goes on with the next part. A part whose turn comes after the budget is spent is
reported NOT RUN. The report is rewritten after every part.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from . import report, travel
from .parts import Part
from .results import PartResult, fill_result

LOG = "parts.log"
LOG_TAIL_LINES = 40
MACHINE_TIMEOUT_S = 120


def part_env() -> dict[str, str]:
    """The parts' environment: the carried site, then the repository, on PYTHONPATH (kvtierd is
    not installed there); gpu tests may not skip."""
    paths = [str(travel.REPO / travel.SITE_DIR), str(travel.REPO), os.environ.get("PYTHONPATH", "")]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in paths if p), KVTIERD_REQUIRE_GPU="1")


def read_machine(env: dict[str, str]) -> dict:
    script = str(Path(__file__).with_name("machine.py"))
    try:
        done = subprocess.run([sys.executable, script], env=env, cwd=travel.REPO, capture_output=True, text=True,
                              timeout=MACHINE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"problems": [f"machine.py did not finish in {MACHINE_TIMEOUT_S} s"]}
    if done.returncode != 0:
        return {"problems": [f"machine.py failed: {done.stderr.strip()[-500:]}"]}
    return json.loads(done.stdout)


def run_part(part: Part, env: dict[str, str], timeout_s: float, work: Path, log) -> PartResult:
    result = PartResult(part.name, part.what)
    junit, tables, part_log = work / f"{part.name}.xml", work / f"{part.name}.tables.jsonl", work / f"{part.name}.log"
    argv = [sys.executable, *part.argv(str(junit))]
    start = time.monotonic()
    with open(part_log, "w") as output:
        process = subprocess.Popen(argv, cwd=travel.REPO, env=dict(env, KVTIERD_BENCH_TABLES=str(tables)),
                                   stdout=output, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            result.returncode = process.wait(timeout_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)  # the part's own process group, daemons included
            result.returncode = process.wait()
            timed_out = True
            result.note = f"killed after {timeout_s:.0f} s"
    result.seconds = time.monotonic() - start
    text = part_log.read_text(errors="replace")
    log.write(f"===== {part.name} ({result.seconds:.1f} s, exit {result.returncode}): {' '.join(argv)}\n{text}\n")
    log.flush()
    result.log_tail = "\n".join(text.splitlines()[-LOG_TAIL_LINES:])
    fill_result(result, part, junit, tables, timed_out)
    return result


def run(parts: list[Part], out_dir: Path, budget_s: float, say=print) -> bool:
    """Installs the carried wheels, runs `parts` within `budget_s`, writes the report; True if all passed."""
    started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    deadline = time.monotonic() + budget_s
    try:
        installed, install_problem = travel.install_there(log=say), None
    except travel.TravelError as e:  # the parts still run: those that need no carried wheel can pass
        installed, install_problem = {}, str(e)
    env = part_env()
    machine = read_machine(env)
    machine["problems"] = ([install_problem] if install_problem else []) + machine.get("problems", [])
    say(f"gpu-acceptance: {report.machine_line(machine)}; problems: {machine.get('problems') or 'none'}")
    results = [PartResult(part.name, part.what) for part in parts]
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="gpu-acceptance-") as work, open(out_dir / LOG, "w") as log:
        for index, part in enumerate(parts):
            left_s = deadline - time.monotonic()
            if left_s < 5:
                results[index].note = "the run's budget was spent"
                continue
            say(f"gpu-acceptance: {part.name} (at most {min(part.timeout_s, left_s):.0f} s)")
            results[index] = run_part(part, env, min(part.timeout_s, left_s), Path(work), log)
            say(f"gpu-acceptance: {part.name}: {results[index].status} in {results[index].seconds:.1f} s")
            report.write(out_dir, results, machine, started, installed)
    return report.write(out_dir, results, machine, started, installed)
