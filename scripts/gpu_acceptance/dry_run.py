"""The CPU dry run (CI): everything the GPU run needs is here, fits, and is found.

1. What travels is built (travel.prepare) and fits the device call (8 paths, 64 MiB); the carried
   protobuf and grpcio satisfy the generated modules.
2. Imported as on the GPU machine (as_gpu_machine.py), the daemon's modules import, and pytest
   collects every part's gpu tests: at least one per part, every named check, every extra node.
3. Every file holding a gpu test belongs to a part (a new gpu test file cannot be left out).
4. Every benchmark script exists and answers `--help` (as on the GPU machine) with its flags.
The first problem found ends the run with a one-line reason (DryRunError).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from . import travel
from .parts import PARTS

AS_GPU_MACHINE = str(Path(__file__).with_name("as_gpu_machine.py"))
DAEMON_MODULES = ("import kvtierd.cli.kvtierd_main, kvtierd.server.serve, kvtierd.client, "
                  "kvtierd.tiering.tier_manager, kvtierd.v1.kvtier_pb2_grpc")
TIMEOUT_S = 300


class DryRunError(Exception):
    """One line: what would fail on the GPU machine."""


def run(argv: list[str], as_gpu_machine: bool) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(travel.REPO), os.environ.get("PYTHONPATH")])))
    env.pop("KVTIERD_REQUIRE_GPU", None)
    prefix = [sys.executable, AS_GPU_MACHINE] if as_gpu_machine else [sys.executable]
    return subprocess.run([*prefix, *argv], cwd=travel.REPO, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)


def last_line(done: subprocess.CompletedProcess) -> str:
    lines = (done.stderr.strip() or done.stdout.strip()).splitlines()
    return lines[-1] if lines else f"exit status {done.returncode}"


def collect_gpu_tests(paths: list[str], as_gpu_machine: bool) -> list[str]:
    done = run(["-m", "pytest", "--collect-only", "-q", "-m", "gpu", "-p", "no:cacheprovider", "--timeout", "1",
                *paths], as_gpu_machine)  # --timeout: pytest-timeout loads, as the parts need
    if done.returncode != 0:
        raise DryRunError(f"pytest --collect-only -m gpu {' '.join(paths)} failed: {last_line(done)}")
    return [line.strip() for line in done.stdout.splitlines() if "::" in line]


def check_travel() -> int:
    try:
        travel.check_generated_runtimes(travel.prepare(log=lambda line: None))
        return travel.check_fits()
    except travel.TravelError as e:
        raise DryRunError(str(e)) from e


def check_tests(extra_node_ids: list[str]) -> int:
    test_parts = [part for part in PARTS if part.is_tests]
    for part in test_parts:
        for path in part.test_files:
            if not (travel.REPO / path).is_file():
                raise DryRunError(f"part {part.name}: {path} does not exist")
    node_ids = collect_gpu_tests([path for part in test_parts for path in part.test_files], as_gpu_machine=True)
    for part in test_parts:
        if not any(node_id.split("::")[0] in part.test_files for node_id in node_ids):
            raise DryRunError(f"part {part.name}: no gpu test collected from {', '.join(part.test_files)}")
    wanted = [check.node_id for part in test_parts for check in part.checks] + list(extra_node_ids)
    for node_id in wanted:
        if not any(n == node_id or n.startswith(node_id + "[") for n in node_ids):
            raise DryRunError(f"test {node_id} is named by the run but not collected (as on the GPU machine)")
    in_parts = {path for part in test_parts for path in part.test_files}
    outside = sorted({n.split("::")[0] for n in collect_gpu_tests(["tests"], as_gpu_machine=False)} - in_parts)
    if outside:
        raise DryRunError(f"gpu tests in {', '.join(outside)} belong to no part (scripts/gpu_acceptance/parts.py)")
    return len(node_ids)


def check_imports_and_benchmarks() -> int:
    done = run(["-c", DAEMON_MODULES], as_gpu_machine=True)
    if done.returncode != 0:
        raise DryRunError(f"the daemon's modules do not import as on the GPU machine: {last_line(done)}")
    benchmarks = [part for part in PARTS if part.benchmark]
    for part in benchmarks:
        script, *flags = part.benchmark
        if not (travel.REPO / script).is_file():
            raise DryRunError(f"part {part.name}: {script} does not exist")
        done = run([script, "--help"], as_gpu_machine=True)
        if done.returncode != 0:
            raise DryRunError(f"part {part.name}: {script} --help failed: {last_line(done)}")
        missing = [flag for flag in flags if flag.startswith("--") and flag not in done.stdout]
        if missing:
            raise DryRunError(f"part {part.name}: {script} has no {', '.join(missing)} flag")
    return len(benchmarks)


def dry_run(extra_node_ids: list[str], say=print) -> None:
    nbytes = check_travel()
    say(f"gpu-acceptance: dry run: carry {', '.join(travel.carry_paths())} ({nbytes / 2**20:.1f} MiB)")
    num_tests = check_tests(extra_node_ids)
    num_benchmarks = check_imports_and_benchmarks()
    say(f"gpu-acceptance: dry run OK: {num_tests} gpu tests collected in {sum(p.is_tests for p in PARTS)} parts, "
        f"{num_benchmarks} benchmarks answer --help, the daemon's modules import")
