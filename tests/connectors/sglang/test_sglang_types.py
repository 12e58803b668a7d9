"""The SGLang storage class type-checked against the installed SGLang: pyright (pyrightconfig-sglang.json)
with the packages of .venv-sglang, where HiCacheStorage and its types resolve. The dev venv's own check
(pyproject.toml's [tool.pyright]) leaves hicache_storage.py out, having no SGLang."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO


@pytest.mark.timeout(300)
def test_pyright_finds_no_error_in_the_sglang_connector_against_the_installed_sglang(sglang_python):
    command = [sys.executable, "-m", "pyright", "-p", "pyrightconfig-sglang.json", "--pythonpath", sglang_python,
               "--outputjson"]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=240)
    assert done.stdout.strip(), done.stderr
    report = json.loads(done.stdout)
    modules = sorted((REPO / "connectors" / "sglang").glob("*.py"))
    assert report["summary"]["filesAnalyzed"] >= len(modules), report["summary"]
    errors = [d for d in report["generalDiagnostics"] if d["severity"] == "error"]
    assert not errors, "\n".join(f"{d['file']}:{d['range']['start']['line'] + 1}: {d['message']}" for d in errors)
