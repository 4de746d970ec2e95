"""Hooks with wrapper implementations (``@hookimpl(wrapper=True)``) fail as every other hook:
each plugin's exception is blamed on it and its ``on_failure`` policy holds."""

from __future__ import annotations

import warnings
from typing import Any

import pytest

from epochal import Loop, hookimpl
from epochal.examples.tiny import TinyModel, tiny_data


class Wrap:
    """Wraps ``after_epoch``: records each call's start and end."""

    def __init__(self, fail: bool = False, isolate: bool = False) -> None:
        self.calls: list[str] = []
        self.fail = fail
        if isolate:
            self.on_failure = "isolate"

    @hookimpl(wrapper=True)
    def after_epoch(self, loop: Any) -> Any:
        self.calls.append("enter")
        result = yield
        self.calls.append("exit")
        if self.fail:
            raise RuntimeError("the wrapper failed")
        return result


class Raiser:
    """Raises in ``after_epoch``; ``on_failure = "isolate"`` when *isolate*."""

    def __init__(self, isolate: bool) -> None:
        self.calls = 0
        if isolate:
            self.on_failure = "isolate"

    @hookimpl
    def after_epoch(self, loop: Any) -> None:
        self.calls += 1
        raise RuntimeError("plain raiser")


class Counter:
    def __init__(self) -> None:
        self.calls = 0

    @hookimpl
    def after_epoch(self, loop: Any) -> None:
        self.calls += 1


def run(plugins: dict[str, object]) -> Loop:
    loop = Loop(TinyModel(), tiny_data(), plugins=plugins, max_epochs=2, handle_signals=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the isolation's warning
        loop.run()
    return loop


def test_an_isolated_plugin_is_isolated_beside_a_wrapper():
    wrap, raiser, counter = Wrap(), Raiser(isolate=True), Counter()
    loop = run({"wrap": wrap, "raiser": raiser, "counter": counter})
    assert "raiser" in loop.log.status["isolated_plugins"]
    assert raiser.calls == 1  # left out after its first failure
    assert counter.calls == 2  # the others ran in both epochs
    assert wrap.calls == ["enter", "exit", "enter", "exit"]


def test_a_fatal_error_beside_a_wrapper_names_its_plugin():
    wrap = Wrap()
    loop = Loop(TinyModel(), tiny_data(), plugins={"wrap": wrap, "raiser": Raiser(False)}, max_epochs=2)
    with pytest.raises(RuntimeError, match="plain raiser") as raised:
        loop.run()
    assert raised.value.epochal_plugin == "raiser"  # type: ignore[attr-defined]
    assert "raised in hook 'after_epoch' of plugin 'raiser'" in raised.value.__notes__
    assert loop.error_plugin == "raiser"
    assert wrap.calls == ["enter"]  # the error went out through the wrapper, which did not end


def test_a_failing_wrapper_is_blamed_and_may_be_isolated():
    fatal = Loop(TinyModel(), tiny_data(), plugins={"wrap": Wrap(fail=True)}, max_epochs=2)
    with pytest.raises(RuntimeError, match="the wrapper failed") as raised:
        fatal.run()
    assert raised.value.epochal_plugin == "wrap"  # type: ignore[attr-defined]
    counter = Counter()
    loop = run({"wrap": Wrap(fail=True, isolate=True), "counter": counter})
    assert "wrap" in loop.log.status["isolated_plugins"]
    assert counter.calls == 2
