"""The root conftest.py's ``slow`` marking, which keeps ``pytest -m "not slow"`` fast: run on a
small suite of its own in a pytest subprocess (pytester), with the repository's conftest.py."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

CONFTEST = Path(__file__).resolve().parents[1] / "conftest.py"

SUITE = """
import os
import subprocess
import sys

import pytest


def run(*args):  # a module's own helper around a process, as tests/test_torch_cli.py has
    return subprocess.run([sys.executable, "-c", "pass", *args], check=True)


def deeper():
    return run()


class Site:
    def call(self):
        return run()


@pytest.fixture
def site():
    return Site()


@pytest.fixture
def ran():
    return deeper()


def test_calls_the_helper():
    run("x")


def test_calls_the_helper_through_another():
    deeper()


def test_uses_a_fixture_whose_class_starts_processes(site):
    assert site


def test_uses_a_fixture_that_ran_a_process(ran):
    assert ran


def test_in_process():
    assert sum(range(4)) == 6


def test_starts_a_process_no_source_shows():
    os.popen("true").read()


@pytest.mark.slow
def test_marked():
    os.popen("true").read()
"""


@pytest.mark.slow  # a pytest subprocess
def test_helpers_and_fixtures_that_start_processes_mark_their_tests_and_an_unmarked_one_fails(
    pytester: pytest.Pytester,
) -> None:
    pytester.makeconftest(CONFTEST.read_text())
    pytester.makepyfile(test_suite=SUITE)
    pytester.makeini("[pytest]\nmarkers =\n    slow: slow\n    distributed: several processes\n")
    fast = pytester.runpytest_subprocess("-m", "not slow", "-rA")
    # marked through the helper, the helper's helper, a fixture's class and a fixture's helper
    fast.assert_outcomes(passed=1, failed=1, deselected=5)
    fast.stdout.fnmatch_lines(
        [
            "*test_starts_a_process_no_source_shows is not marked slow but started 1 process(es), "
            "first: subprocess.Popen /bin/sh -c true; mark it @pytest.mark.slow*",
        ]
    )
    assert "PASSED test_suite.py::test_in_process" in fast.stdout.str()
    everything = pytester.runpytest_subprocess("-m", "slow")
    everything.assert_outcomes(passed=5, deselected=2)
