"""Marks for the whole repository's tests: ``slow`` on every test that starts processes or sleeps.

``pytest -m "not slow"`` is the contributor's fast inner loop (README, "Contributing"); CI runs
everything. A test is slow when it is marked so, runs several processes (``distributed``), or
when its own code, a fixture it uses, or a helper that either calls starts a process or sleeps.
Helpers are followed by name through the test files (``tests`` folders, ``conftest.py``) and the
``epochal*.testing`` modules, so a module's own ``run`` helper around ``epochal_command`` counts.

The marking is also checked where processes are made: an audit hook sees every process a test
starts (``subprocess``, ``os.fork``, ``os.posix_spawn``, ``os.system``, ``os.exec*``), and a test
not marked slow that starts one, in its setup or its call, fails saying so. So ``-m "not slow"``
cannot quietly grow slow again: mark such a test ``@pytest.mark.slow`` (or name its helper here).
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

#: what code says when it starts a process or waits.
SLOW_CALLS = (
    "subprocess", "Popen", "epochal_command(", "time.sleep(", "epochal(", "run_cli(", "cli(", "os.fork",
    "posix_spawn", "os.system(",
)  # fmt: skip
#: the audit events of process creation (see the "Audit events table" of Python's docs).
PROCESS_EVENTS = frozenset(
    {"subprocess.Popen", "os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.exec", "os.system"}
)
ROOT = Path(__file__).resolve().parent

_verdicts: dict[types.CodeType, bool] = {}


@functools.cache
def _test_module(name: str) -> bool:
    """Whether module *name* holds test code whose calls are followed: a file of this repository
    in a ``tests`` folder, a ``test_*.py`` or ``conftest.py``, or an ``epochal*.testing`` module."""
    if name.startswith("epochal") and name.rpartition(".")[2] == "testing":
        return True
    file = getattr(sys.modules.get(name), "__file__", None)
    if not file:
        return False
    path = Path(file).resolve()
    if not path.is_relative_to(ROOT):
        return False
    return "tests" in path.relative_to(ROOT).parts or path.name.startswith(("test_", "conftest"))


def _followed(thing: Any) -> bool:
    """Whether *thing* is a function or class of a module :func:`_test_module` follows."""
    if not isinstance(thing, (types.FunctionType, type)):
        return False
    return _test_module(getattr(thing, "__module__", None) or "")


def _codes(code: types.CodeType) -> Iterator[types.CodeType]:
    """*code* and the code of the functions, lambdas and comprehensions nested in it."""
    yield code
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            yield from _codes(constant)


def _callees(function: types.FunctionType) -> Iterator[Any]:
    """The followed functions and classes *function* names (globals, and attributes of modules)."""
    names = {name for code in _codes(function.__code__) for name in code.co_names}
    scope = function.__globals__
    for name in names:
        value = scope.get(name)
        if isinstance(value, types.ModuleType):  # `processes.wait_for(...)`: the attributes named
            if not _test_module(value.__name__):
                continue
            for attribute in names:
                found = getattr(value, attribute, None)
                if found is not None and _followed(found):
                    yield found
        elif value is not None and _followed(value):
            yield value


def _starts_processes(thing: Any) -> bool:
    """Whether the source of function or class *thing*, or of a followed helper it names, starts
    a process or sleeps (looked at once per function)."""
    if isinstance(thing, type):
        return any(_starts_processes(v) for v in vars(thing).values() if isinstance(v, types.FunctionType))
    function = inspect.unwrap(thing)
    if not isinstance(function, types.FunctionType):
        return False
    code = function.__code__
    if code in _verdicts:
        return _verdicts[code]
    _verdicts[code] = False  # while it is looked at: a helper that calls itself
    try:
        source = inspect.getsource(function)
    except (OSError, TypeError):
        source = ""
    verdict = any(call in source for call in SLOW_CALLS) or any(map(_starts_processes, _callees(function)))
    _verdicts[code] = verdict
    return verdict


def _fixture_functions(item: pytest.Item) -> Iterator[Any]:
    """The functions of the fixtures *item* uses (directly or through other fixtures)."""
    info = getattr(item, "_fixtureinfo", None)
    for definitions in getattr(info, "name2fixturedefs", {}).values():
        for definition in definitions:
            yield definition.func


def _slow(item: pytest.Item) -> bool:
    if item.get_closest_marker("slow") or item.get_closest_marker("distributed"):
        return True
    function = getattr(item, "function", None)
    if function is not None and _starts_processes(function):
        return True
    return any(map(_starts_processes, _fixture_functions(item)))


def _shared_runs(item: pytest.Item) -> list[str]:
    """The fixtures wider than a test that *item* uses and that start processes (a server, a
    run of several processes whose results a module's tests share)."""
    fixtures = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})

    def starts_processes(definition: Any) -> bool:  # itself, or a fixture it calls (an installer)
        used = [fixtures[name][-1].func for name in definition.argnames if fixtures.get(name)]
        return any(map(_starts_processes, [definition.func, *used]))

    return [
        f"{definition.baseid}::{definition.argname}"
        for definitions in fixtures.values()
        for definition in definitions[-1:]
        if definition.scope in ("class", "module", "package") and starts_processes(definition)
    ]


#: what a pytest-xdist worker's environment must hold as the main process's: the worker imports
#: readline, which sets COLUMNS=80 and LINES=24, and the tests' commands then wrapped their
#: summaries at 80 columns (a pipe has no width).
TERMINAL_VARIABLES = ("COLUMNS", "LINES")


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """pytest-xdist, in the main process: hand each worker this process's terminal variables."""
    node.workerinput["epochal_terminal"] = {name: os.environ.get(name) for name in TERMINAL_VARIABLES}


def pytest_configure(config: pytest.Config) -> None:
    """In a pytest-xdist worker: the main process's terminal variables, not readline's."""
    terminal = getattr(config, "workerinput", {}).get("epochal_terminal")
    for name, value in (terminal or {}).items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's hook reads the xdist_group marks
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if _slow(item):
            item.add_marker(pytest.mark.slow)
        # under `pytest -n N --dist loadgroup` (tox.ini) the tests sharing such a fixture run on
        # one worker, which makes it once, instead of every worker making its own
        for shared in _shared_runs(item):
            item.add_marker(pytest.mark.xdist_group(shared))


#: the processes started by the test now watched (None: no test is watched).
_started: list[str] | None = None


#: what a library starts once per machine to fill a cache, whichever test imports it first:
#: matplotlib lists the fonts with fc-list when it has no font cache yet (a fresh CI machine).
ONCE_PER_MACHINE = frozenset({"fc-list"})


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if event in PROCESS_EVENTS and _started is not None:
        command = args[1] if event == "subprocess.Popen" else ()  # (executable, args, cwd, env)
        words = [command] if isinstance(command, (str, bytes)) else list(command or ())
        if words and Path(os.fsdecode(words[0]).split()[0]).name in ONCE_PER_MACHINE:
            return
        _started.append(" ".join([event, *map(str, words)])[:200])


sys.addaudithook(_audit)


def _watch(item: pytest.Item) -> Iterator[None]:
    """Run a phase of *item*; fail it if it is not marked slow and started a process."""
    global _started
    if item.get_closest_marker("slow"):
        yield
        return
    started: list[str] = []
    _started = started
    try:
        yield
    finally:
        _started = None
    if started:
        pytest.fail(
            f"{item.nodeid} is not marked slow but started {len(started)} process(es), first: "
            f"{started[0]}; mark it @pytest.mark.slow (the root conftest.py says how tests are marked)",
            pytrace=False,
        )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    yield from _watch(item)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    yield from _watch(item)
