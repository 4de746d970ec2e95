"""Marks for the whole repository's tests: ``slow`` on every test that starts processes or sleeps.

``pytest -m "not slow"`` is the contributor's fast inner loop (README, "Contributing"); CI runs
everything. A test is slow when it is marked so, runs several processes (``distributed``), uses a
fixture that runs the ``epochal`` command, or its own code starts a process or sleeps.
"""

from __future__ import annotations

import inspect

import pytest

#: fixtures that run the ``epochal`` command in a subprocess.
CLI_FIXTURES = {"epochal_cli", "throwaway_cli", "npy_site", "straight"}
#: what a test's own code says when it starts a process or waits.
SLOW_CALLS = ("subprocess", "Popen", "epochal_command(", "time.sleep(", "epochal(", "run_cli(", "cli(")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("slow") or item.get_closest_marker("distributed"):
            item.add_marker(pytest.mark.slow)
            continue
        if CLI_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
            continue
        function = getattr(item, "function", None)
        try:
            source = inspect.getsource(function) if function is not None else ""
        except (OSError, TypeError):
            source = ""
        if any(call in source for call in SLOW_CALLS):
            item.add_marker(pytest.mark.slow)
