"""What a part's run left behind, read back: the pytest junit XML and the benchmarks' tables.

A part's result is one PartResult; `status` is PASS only when the process exited 0 and left what
its kind must leave (tests: at least one passed and none failed; every named check passed;
a benchmark: at least one table).
"""

from __future__ import annotations

import dataclasses
import json
import xml.etree.ElementTree as ElementTree
from pathlib import Path

from .parts import Check, Part

PASS, FAIL, TIMEOUT, NOT_RUN = "PASS", "FAIL", "TIMEOUT", "NOT RUN"
MAX_LISTED_FAILURES = 20


@dataclasses.dataclass
class PartResult:
    name: str
    what: str
    status: str = NOT_RUN
    seconds: float = 0.0
    returncode: int | None = None
    tests: dict | None = None  # {"passed", "failed", "skipped", "failures": [node ids]}
    checks: list[dict] = dataclasses.field(default_factory=list)  # {"what", "node_id", "result"}
    tables: list[dict] = dataclasses.field(default_factory=list)  # {"title", "headers", "rows"}
    log_tail: str = ""
    note: str = ""


def junit_outcomes(path: Path) -> dict[str, str]:
    """{node id: "passed" | "failed" | "skipped"} from pytest's --junitxml file ({} if missing)."""
    if not path.is_file():
        return {}
    outcomes = {}
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        node_id = case.get("classname", "").replace(".", "/") + ".py::" + case.get("name", "")
        kinds = {child.tag for child in case}
        outcomes[node_id] = "failed" if kinds & {"failure", "error"} else "skipped" if "skipped" in kinds else "passed"
    return outcomes


def check_result(check: Check, outcomes: dict[str, str]) -> str:
    """PASS when every case of the check's test passed, FAIL if one did not, NOT RUN if none ran."""
    cases = [outcome for node_id, outcome in outcomes.items()
             if node_id == check.node_id or node_id.startswith(check.node_id + "[")]
    if not cases:
        return NOT_RUN
    return PASS if all(outcome == "passed" for outcome in cases) else FAIL


def read_tables(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def fill_result(result: PartResult, part: Part, junit: Path, tables: Path, timed_out: bool) -> None:
    """Sets tests, checks, tables and status from what the part's process left."""
    if part.is_tests:
        outcomes = junit_outcomes(junit)
        counts = {kind: sum(1 for o in outcomes.values() if o == kind) for kind in ("passed", "failed", "skipped")}
        failures = [node_id for node_id, outcome in outcomes.items() if outcome != "passed"]
        result.tests = {**counts, "failures": failures[:MAX_LISTED_FAILURES]}
        result.checks = [{"what": c.what, "node_id": c.node_id, "result": check_result(c, outcomes)}
                         for c in part.checks]
        complete = counts["passed"] > 0 and counts["failed"] == counts["skipped"] == 0 \
            and all(c["result"] == PASS for c in result.checks)
    else:
        result.tables = read_tables(tables)
        complete = bool(result.tables)
    if timed_out:
        result.status = TIMEOUT
    else:
        result.status = PASS if result.returncode == 0 and complete else FAIL
