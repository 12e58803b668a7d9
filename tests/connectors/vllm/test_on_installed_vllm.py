"""The tests of tests/connectors/vllm/on_vllm, run in the vLLM venv: the connector on the installed vLLM's own
objects, the block index against vLLM's own prefix cache, and the KV event feed decoded by vLLM's own classes."""

from __future__ import annotations

import re
import subprocess

import pytest

from tests.conftest import REPO


@pytest.mark.on_vllm
@pytest.mark.timeout(900)
def test_the_connector_unit_tests_pass_on_the_installed_vllms_objects(vllm_python):
    """Every test of tests/connectors/vllm/on_vllm runs and passes there: none skipped, none failed."""
    command = [vllm_python, "-m", "pytest", "tests/connectors/vllm/on_vllm", "-q", "-p", "no:cacheprovider"]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=840)
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    passed = re.search(r"(\d+) passed", summary)
    assert passed and int(passed.group(1)) >= 22, summary
    assert not re.search(r"skipped|failed|error", summary), summary
