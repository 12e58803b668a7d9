"""The run's report: report.md (tables to paste into a note) and report.json, under one directory.

Rewritten after every part, so a run cut short still leaves the parts it finished.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from .results import FAIL, PASS, PartResult

MARKDOWN, JSON = "report.md", "report.json"


def passed(results: list[PartResult], machine: dict) -> bool:
    return not machine.get("problems") and bool(results) and all(r.status == PASS for r in results)


def md_row(cells) -> str:
    return "| " + " | ".join(str(cell).replace("|", "\\|") for cell in cells) + " |"


def md_table(headers, rows) -> list[str]:
    return [md_row(headers), md_row(["---"] * len(headers)), *(md_row(row) for row in rows)]


def machine_line(machine: dict) -> str:
    return (f"{machine.get('device', 'no CUDA device')}; Python {machine.get('python', '?')}, torch "
            f"{machine.get('torch', '?')} (CUDA {machine.get('torch_cuda', '?')}), "
            f"CuPy {machine.get('cupy', 'missing')}, "
            f"grpcio {machine.get('grpcio', '?')}, protobuf {machine.get('protobuf', '?')}")


def markdown(results: list[PartResult], machine: dict, started: str, installed: dict[str, str]) -> str:
    verdict = PASS if passed(results, machine) else FAIL
    num_passed = sum(r.status == PASS for r in results)
    lines = ["# kvtierd GPU acceptance run", "", f"{started}: {machine_line(machine)}", "",
             f"Result: **{verdict}**, {num_passed} of {len(results)} parts passed, "
             f"{sum(r.seconds for r in results):.0f} s of parts.", ""]
    lines += [f"- problem on the machine: {problem}" for problem in machine.get("problems", [])]
    lines += [f"- {dist}: {action}" for dist, action in installed.items()]
    lines += ["", *md_table(["part", "what", "result", "seconds", "detail"],
                            [[r.name, r.what, r.status, f"{r.seconds:.1f}", detail(r)] for r in results])]
    checks = [c for r in results for c in r.checks]
    if checks:
        lines += ["", "## Checks", "", *md_table(["check", "test", "result"],
                                                 [[c["what"], f"`{c['node_id']}`", c["result"]] for c in checks])]
    for result in results:
        for table in result.tables:
            lines += ["", f"## {result.name}: {table['title']}", "", *md_table(table["headers"], table["rows"])]
    failed = [r for r in results if r.status != PASS and r.log_tail]
    for result in failed:
        lines += ["", f"## {result.name} ({result.status}): the end of its output", "", "```", result.log_tail, "```"]
    return "\n".join(lines) + "\n"


def detail(result: PartResult) -> str:
    if result.note:
        return result.note
    if result.tests is not None:
        t = result.tests
        failures = f"; not passed: {', '.join(t['failures'])}" if t["failures"] else ""
        return f"{t['passed']} passed, {t['failed']} failed, {t['skipped']} skipped{failures}"
    misses = sum(1 for table in result.tables for row in table["rows"] if row and row[-1] == "MISS")
    return f"{len(result.tables)} table(s), {misses} goal(s) missed" if result.tables else ""


def write(out_dir: Path, results: list[PartResult], machine: dict, started: str,
          installed: dict[str, str]) -> bool:
    """Writes both files; returns whether the run passed."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / MARKDOWN).write_text(markdown(results, machine, started, installed))
    document = {"started": started, "passed": passed(results, machine), "machine": machine, "installed": installed,
                "parts": [dataclasses.asdict(r) for r in results]}
    (out_dir / JSON).write_text(json.dumps(document, indent=1) + "\n")
    return document["passed"]
