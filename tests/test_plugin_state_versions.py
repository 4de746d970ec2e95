"""A plugin's saved state and its layout (``state_version``, ``migrate_state``) on resume."""

from __future__ import annotations

import copy
import shutil
from typing import Any, ClassVar

import pytest

from epochal import Loop, hookimpl
from epochal.errors import EpochalError, PluginError
from epochal.examples.tiny import TinyModel, tiny_data


class CounterV1:
    """Counts batches; its state is ``{"n": count}``."""

    def __init__(self) -> None:
        self.n = 0

    @hookimpl
    def after_batch(self) -> None:
        self.n += 1

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.n = state["n"]


class CounterV2:
    """The same count in a new layout, ``{"batches": count}``, which it migrates version 1 to."""

    state_version: ClassVar[int] = 2
    migrated: ClassVar[list[int]] = []

    def __init__(self) -> None:
        self.batches = 0

    @hookimpl
    def after_batch(self) -> None:
        self.batches += 1

    def state_dict(self) -> dict[str, Any]:
        return {"batches": self.batches}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.batches = state["batches"]

    def migrate_state(self, state: dict[str, Any], version: int) -> dict[str, Any]:
        self.migrated.append(version)
        return {"batches": state["n"]}


class CounterV2NoMigration(CounterV1):
    state_version: ClassVar[int] = 2


class CounterV2Broken(CounterV2):
    def migrate_state(self, state: dict[str, Any], version: int) -> dict[str, Any]:
        return {"batches": state["count"]}  # a key version 1 never had


def saved_by(plugin: object) -> dict[str, Any]:
    loop = Loop(TinyModel(), tiny_data(), plugins={"counter": plugin}, max_epochs=1, handle_signals=False)
    loop.run()
    return copy.deepcopy(loop.state_dict())


def load_into(plugin: object, state: dict[str, Any]) -> Loop:
    loop = Loop(TinyModel(), tiny_data(), plugins={"counter": plugin}, max_epochs=2, handle_signals=False)
    loop.load_state_dict(state)
    return loop


def test_a_state_of_an_older_layout_goes_through_migrate_state():
    state = saved_by(CounterV1())
    CounterV2.migrated.clear()
    plugin = CounterV2()
    load_into(plugin, state)
    assert CounterV2.migrated == [1]
    assert plugin.batches == 4  # the count saved after one epoch of 4 batches


def test_the_saved_layout_is_kept_beside_the_state():
    assert saved_by(CounterV2())["plugins"]["counter"]["state_version"] == 2
    assert saved_by(CounterV1())["plugins"]["counter"]["state_version"] == 1


@pytest.mark.parametrize(
    ("saved_with", "loaded_with", "message"),
    [
        (
            CounterV1,
            CounterV2NoMigration,
            r"cannot resume: plugin 'counter' saved its state in layout state_version = 1; this run's "
            r"reads state_version = 2 and has no migrate_state\(state, version\) to bring it up to date: "
            r"resume with the version that saved it, or start afresh \(without --resume\)",
        ),
        (
            CounterV2,
            CounterV1,
            r"cannot resume: plugin 'counter' saved its state in layout state_version = 2, newer than "
            r"the state_version = 1 that this run's reads",
        ),
        (
            CounterV1,
            CounterV2Broken,
            r"plugin 'counter' .* failed to migrate it to state_version = 2: KeyError: 'count'",
        ),
    ],
    ids=["older-without-migrate-state", "newer", "migrate-state-raises"],
)
def test_a_state_the_plugin_cannot_read_is_one_error_naming_it(saved_with, loaded_with, message):
    state = saved_by(saved_with())
    with pytest.raises(EpochalError, match=message):
        load_into(loaded_with(), state)


PLUGIN = """
from epochal import hookimpl


class Counter:
    state_version = {version}

    def __init__(self):
        self.n = 0

    @hookimpl
    def after_batch(self):
        self.n += 1

    def state_dict(self):
        return {{"n": self.n}}

    def load_state_dict(self, state):
        self.n = state["n"]
"""


def test_resuming_through_the_cli_names_the_plugin_and_loses_no_checkpoint(throwaway_cli, write_config):
    config = write_config(["checkpoint", "counter"], extra='[plugins.counter]\nfactory = "counter:Counter"\n')
    plugin = config.parent / "counter.py"
    plugin.write_text(PLUGIN.format(version=1))
    first = throwaway_cli("run", str(config))
    assert first.returncode == 0, first.stderr
    saved = sorted(p.name for p in config.parent.glob("runs/**/*") if p.is_file())
    plugin.write_text(PLUGIN.format(version=2))
    shutil.rmtree(config.parent / "__pycache__", ignore_errors=True)
    resumed = throwaway_cli("run", str(config), "--resume")
    assert resumed.returncode != 0
    assert "cannot resume: plugin 'counter' saved its state in layout state_version = 1" in resumed.stderr
    assert "has no migrate_state" in resumed.stderr
    assert "Traceback" not in resumed.stderr, resumed.stderr
    # what the first run wrote is all there (the failed start may add its own run's files)
    assert set(saved) <= {p.name for p in config.parent.glob("runs/**/*") if p.is_file()}


class Renamed(CounterV1):
    """Reads the count under a key version 1 never wrote, without raising state_version."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.n = state["count"]


def test_a_load_state_dict_that_raises_is_one_error_naming_the_plugin():
    state = saved_by(CounterV1())
    with pytest.raises(
        PluginError,
        match=r"cannot resume: plugin 'counter' failed to load its saved state: KeyError: 'count'",
    ):
        load_into(Renamed(), state)
