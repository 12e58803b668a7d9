"""The vLLM connector type-checked against the installed vLLM: pyright (pyrightconfig-vllm.json) with the
packages of .venv-vllm, where the connector's vLLM base classes and imports resolve. The dev venv's own
check (pyproject.toml's [tool.pyright]) leaves the package out, having no vLLM."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO


def pyright_over_the_connector(vllm_python: str) -> dict:
    """pyright's JSON report (--outputjson) of pyrightconfig-vllm.json against `vllm_python`'s packages."""
    command = [sys.executable, "-m", "pyright", "-p", "pyrightconfig-vllm.json", "--pythonpath", vllm_python,
               "--outputjson"]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=240)
    assert done.stdout.strip(), done.stderr
    return json.loads(done.stdout)


@pytest.mark.timeout(300)
def test_pyright_finds_no_error_in_any_connector_module_against_the_installed_vllm(vllm_python):
    """Every module of connectors/vllm is checked, and none has an error."""
    report = pyright_over_the_connector(vllm_python)
    modules = sorted((REPO / "connectors" / "vllm").glob("*.py"))
    assert report["summary"]["filesAnalyzed"] >= len(modules), report["summary"]
    errors = [d for d in report["generalDiagnostics"] if d["severity"] == "error"]
    assert not errors, "\n".join(f"{d['file']}:{d['range']['start']['line'] + 1}: {d['message']}" for d in errors)
