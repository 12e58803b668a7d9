"""scripts/gpu-acceptance: the CPU dry run passes and catches a test it cannot find; gpu tests fail
instead of skipping under KVTIERD_REQUIRE_GPU=1; parts are selected, run under a time limit and
read back into the report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvtierd.launch.daemon_process import wait_until
from scripts.gpu_acceptance import parts, report, runner, travel
from scripts.gpu_acceptance.results import FAIL, PASS, TIMEOUT, PartResult

REPO = Path(__file__).resolve().parents[2]
SCRIPT = str(REPO / "scripts" / "gpu-acceptance")
NO_CUDA_ENV = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(REPO))


def acceptance(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, SCRIPT, *args], cwd=REPO, capture_output=True, text=True, timeout=600)


@pytest.mark.slow  # a dry run of the whole GPU acceptance script
def test_dry_run_passes_and_the_carry_fits():
    done = acceptance("--dry-run")
    assert done.returncode == 0, done.stderr
    assert "dry run OK" in done.stdout and "0 benchmarks" not in done.stdout
    assert travel.check_fits() <= travel.MAX_CARRY_BYTES
    carried = {travel.wheel_name_version(path)[0] for path in (REPO / travel.WHEELS_DIR).glob("*.whl")}
    assert carried == {travel.normalize(dist) for dist in travel.DISTRIBUTIONS}


@pytest.mark.slow  # a dry run of the whole GPU acceptance script
def test_dry_run_fails_with_one_line_when_a_named_test_is_missing():
    done = acceptance("--dry-run", "--require-node", "tests/t0/test_cuda_pool.py::test_that_does_not_exist")
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        "gpu-acceptance: test tests/t0/test_cuda_pool.py::test_that_does_not_exist is named by the run but not "
        "collected (as on the GPU machine)"]


@pytest.mark.slow  # a dry run of the whole GPU acceptance script
def test_a_gpu_test_fails_instead_of_skipping_when_gpus_are_required():
    """Without CUDA: KVTIERD_REQUIRE_GPU=1 makes the skipif'd IPC test an error; unset, it skips."""
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu",
            "tests/t0/test_cuda_pool.py::test_second_process_maps_the_pool_through_the_ipc_handle",
            "tests/movers/test_fp8_codec.py::test_cuda_dequantize_from_unpacked_slot_views"]
    required = subprocess.run(argv, cwd=REPO, env=dict(NO_CUDA_ENV, KVTIERD_REQUIRE_GPU="1"), capture_output=True,
                              text=True, timeout=300)
    assert required.returncode == 1 and "2 errors" in required.stdout, required.stdout
    assert "KVTIERD_REQUIRE_GPU=1" in required.stdout
    skipped = subprocess.run(argv, cwd=REPO, env=NO_CUDA_ENV, capture_output=True, text=True, timeout=300)
    assert skipped.returncode == 0 and "2 skipped" in skipped.stdout, skipped.stdout


def test_only_selects_parts_in_run_order_and_names_unknown_ones():
    assert [p.name for p in parts.select("bench-copy, tests-pool")] == ["tests-pool", "bench-copy"]
    assert [p.name for p in parts.select(None)] == list(parts.PART_NAMES)
    with pytest.raises(ValueError, match="bench-nope"):
        parts.select("tests-pool,bench-nope")


def test_a_part_that_hangs_is_killed_with_its_children(tmp_path):
    hang = ("import subprocess, sys; child = subprocess.Popen([sys.executable, '-c', "
            "'import threading; threading.Event().wait()']); print(child.pid, flush=True); child.wait()")
    part = parts.Part("bench-hang", "hangs", 5, benchmark=("-c", hang))
    with open(tmp_path / "log", "w") as log:
        result = runner.run_part(part, NO_CUDA_ENV, 2, tmp_path, log)
    assert result.status == TIMEOUT and result.note == "killed after 2 s"
    grandchild = int(result.log_tail.split()[0])
    assert wait_until(lambda: not Path(f"/proc/{grandchild}").exists() or "zombie" in
                      Path(f"/proc/{grandchild}/status").read_text(errors="replace"), timeout_s=10)


@pytest.mark.slow  # a dry run of the whole GPU acceptance script
def test_parts_are_read_back_into_the_report(tmp_path):
    """A benchmark's table and a failed gpu test part (no CUDA) land in report.md and report.json."""
    bench = parts.Part("bench-copy", "copy", 120, benchmark=("benchmarks/bench_tier_copy.py", "--quick"))
    tests = next(p for p in parts.PARTS if p.name == "tests-pool")
    env = dict(NO_CUDA_ENV, KVTIERD_REQUIRE_GPU="1")
    with open(tmp_path / "log", "w") as log:
        results = [runner.run_part(part, env, 300, tmp_path, log) for part in (bench, tests)]
    assert results[0].status == PASS and [len(t["rows"]) for t in results[0].tables] == [18]  # the copy sweep
    assert results[1].status == FAIL and results[1].tests["passed"] == 0 and results[1].tests["failed"] > 0
    assert results[1].checks[0]["result"] == FAIL
    results.append(PartResult("bench-ttft", "ttft", note="the run's budget was spent"))
    assert not report.write(tmp_path / "out", results, {"device": "H200", "problems": []}, "now", {})
    document = json.loads((tmp_path / "out" / report.JSON).read_text())
    assert [p["status"] for p in document["parts"]] == [PASS, FAIL, "NOT RUN"] and document["passed"] is False
    markdown = (tmp_path / "out" / report.MARKDOWN).read_text()
    assert "| 2 MiB shuffled both |" in markdown and "Result: **FAIL**, 1 of 3 parts passed" in markdown
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [report.JSON, report.MARKDOWN]


def test_carried_runtimes_older_than_the_generated_code_are_refused():
    wheels = [Path("protobuf-7.0.0-cp310-abi3-manylinux2014_x86_64.whl"),
              Path("grpcio-1.85.3-cp312-cp312-manylinux2014_x86_64.whl")]
    needed = travel.generated_needs()["protobuf"]
    assert travel.version_key(needed) > travel.version_key("7.0.0")
    with pytest.raises(travel.TravelError, match=f"protobuf>={needed}"):
        travel.check_generated_runtimes(wheels)
    assert travel.version_key("1.85.3") > travel.version_key("1.85.1") > travel.version_key("1.9.0")
