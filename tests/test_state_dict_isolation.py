"""A plugin whose ``state_dict()`` raises (issue 44, item 7): with ``on_failure = "isolate"``
it is left out and the run goes on, its state out of the checkpoint; fatal, the error names it
and ``state_dict``, not the plugin that asked for the state (a checkpoint's hook)."""

from __future__ import annotations

import warnings
from typing import Any

import pytest

from epochal import Loop, hookimpl
from epochal.examples.tiny import TinyModel, tiny_data
from epochal.plugins import PluginIsolatedWarning


class Broken:
    """A plugin with a state whose ``state_dict()`` raises."""

    def __init__(self, isolate: bool) -> None:
        self.calls = 0
        if isolate:
            self.on_failure = "isolate"

    @hookimpl
    def after_batch(self, loop: Any) -> None:
        self.calls += 1

    def state_dict(self) -> dict[str, Any]:
        raise RuntimeError("cannot say its state")

    def load_state_dict(self, state: Any) -> None:
        pass


class Kept:
    def state_dict(self) -> dict[str, Any]:
        return {"kept": 1}

    def load_state_dict(self, state: Any) -> None:
        pass


class Saver:
    """Takes the loop's state at each epoch end, as a checkpoint plugin does."""

    def __init__(self) -> None:
        self.saved: list[dict[str, Any]] = []

    @hookimpl
    def after_epoch(self, loop: Any) -> None:
        self.saved.append(loop.state_dict())


def test_an_isolated_plugin_whose_state_dict_raises_is_left_out_and_the_run_goes_on() -> None:
    broken, saver = Broken(isolate=True), Saver()
    loop = Loop(
        TinyModel(),
        tiny_data(),
        plugins={"saver": saver, "broken": broken, "kept": Kept()},
        max_epochs=2,
        handle_signals=False,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        log = loop.run()
    assert log.status["status"] == "finished"
    assert len(saver.saved) == 2 and all(set(s["plugins"]) == {"kept"} for s in saver.saved)
    assert log.status["isolated_plugins"] == {"broken": "state_dict: RuntimeError: cannot say its state"}
    isolated = [w for w in caught if issubclass(w.category, PluginIsolatedWarning)]
    assert len(isolated) == 1
    assert str(isolated[0].message).startswith("plugin 'broken' raised in state_dict(): RuntimeError")
    assert "its state is left out of checkpoints" in str(isolated[0].message)
    assert broken.calls == 4  # its hooks ran until the first save, then it was left out


def test_a_fatal_state_dict_error_names_that_plugin_not_the_one_that_asked() -> None:
    loop = Loop(
        TinyModel(),
        tiny_data(),
        plugins={"saver": Saver(), "broken": Broken(isolate=False)},
        max_epochs=2,
        handle_signals=False,
    )
    with pytest.raises(RuntimeError, match="cannot say its state") as raised:
        loop.run()
    assert raised.value.epochal_plugin == "broken"  # type: ignore[attr-defined]
    assert raised.value.epochal_hook == "state_dict"  # type: ignore[attr-defined]
    assert loop.error_plugin == "broken"


def test_a_saver_that_is_isolated_itself_does_not_isolate_the_plugin_it_asked() -> None:
    """The saver's own policy does not apply to another plugin's state_dict: fatal stays fatal."""
    saver = Saver()
    saver.on_failure = "isolate"  # type: ignore[attr-defined]
    loop = Loop(
        TinyModel(),
        tiny_data(),
        plugins={"saver": saver, "broken": Broken(isolate=False)},
        max_epochs=2,
        handle_signals=False,
    )
    with pytest.raises(RuntimeError, match="cannot say its state"):
        loop.run()
    assert "isolated_plugins" not in loop.log.status
