"""The test lanes (tests/lanes.py): each test is in exactly one, the one of its most demanding
marker, whether the marker is written on the test or comes from a fixture it uses; the fast lane
runs with the fast hypothesis profile."""

from __future__ import annotations

import pytest
from hypothesis import settings

from tests import lanes
from tests.conftest import hypothesis_profile

pytest_plugins = ["pytester"]

CONFTEST = "from tests.conftest import pytest_addoption, pytest_configure, pytest_collection_modifyitems\n"
SUITE = '''
import pytest
from hypothesis import settings

@pytest.fixture
def redis_cluster():
    return "a cluster"

@pytest.fixture
def two_nodes(redis_cluster):  # a cluster one fixture away
    return redis_cluster

def test_plain():
    pass

def test_on_a_cluster(two_nodes):
    pass

@pytest.mark.slow
def test_slow():
    pass

@pytest.mark.slow
@pytest.mark.vllm
def test_slow_on_vllm():
    pass

@pytest.mark.gpu
def test_gpu():
    pass

def test_examples_of_the_profile():
    print("max_examples", settings.default.max_examples)
'''
EXPECTED_LANES = {"test_plain": "fast", "test_on_a_cluster": "cluster", "test_slow": "slow",
                  "test_slow_on_vllm": "vllm", "test_gpu": "gpu", "test_examples_of_the_profile": "fast"}


@pytest.fixture
def suite(pytester, request):
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_suite=SUITE)
    yield pytester
    settings.load_profile(hypothesis_profile(request.config))  # the inner runs loaded theirs


def collected(pytester, *args: str) -> set[str]:
    """The names of the tests a run with `args` keeps (after the lanes deselect theirs)."""
    recorder = pytester.inline_run("--collect-only", *args)
    return {item.name for item in recorder.getcall("pytest_collection_modifyitems").items}


def test_every_test_is_in_exactly_the_lane_of_its_most_demanding_marker(suite):
    """The lanes partition the suite, and each test lands where its markers and fixtures say."""
    lane_tests = {lane: collected(suite, "--lane", lane) for lane in lanes.LANE_NAMES}
    assert {name: lane for lane, names in lane_tests.items() for name in names} == EXPECTED_LANES
    assert sum(len(names) for names in lane_tests.values()) == len(EXPECTED_LANES)
    assert collected(suite) == set(EXPECTED_LANES)  # no --lane: every lane


def test_a_fixtures_marker_selects_the_test_with_m(suite):
    """A test that uses a cluster fixture carries the `cluster` marker, for -m as for --lane."""
    assert collected(suite, "-m", "cluster") == {"test_on_a_cluster"}


@pytest.mark.parametrize("args, max_examples", [(["--lane", "fast"], 20), (["--lane", "slow"], None), ([], 100),
                                                (["--lane", "fast", "--hypothesis-profile", "ci"], 100)])
def test_the_fast_lane_has_the_fast_hypothesis_profile(suite, args, max_examples):
    """Fast lane: 20 examples a test; any other run: the ci profile's 100; --hypothesis-profile wins."""
    result = suite.runpytest_inprocess("-s", "-k", "examples_of_the_profile", *args)
    if max_examples is None:
        assert result.ret == pytest.ExitCode.NO_TESTS_COLLECTED  # that test is in the fast lane
    else:
        assert result.ret == 0
        result.stdout.fnmatch_lines([f"*max_examples {max_examples}"])
