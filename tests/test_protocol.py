"""The plugin protocol in code (``epochal.protocol``): phases order plugins, declarations are read
in one place, and the standard plugins declare with its types."""

from __future__ import annotations

import typing

import pytest

from epochal import hookimpl
from epochal.errors import OrderError, PluginError
from epochal.ordering import call_order
from epochal.plugins import compose
from epochal.protocol import DEFAULTS, PHASES, Declarations, Stateful, declared


def Staged(phase: str | None) -> object:  # noqa: N802 - a class per phase, made like one
    """A plugin whose class declares *phase*."""

    class Plugin:
        @hookimpl
        def after_epoch(self, loop):
            pass

    Plugin.phase = phase  # type: ignore[attr-defined]
    return Plugin()


def test_an_instance_attribute_called_phase_declares_nothing():
    class Busy:
        def __init__(self) -> None:
            self.phase = "warming up"  # its own state, not a declaration

        @hookimpl
        def after_epoch(self, loop):
            pass

    assert compose({"busy": Busy(), "saver": Staged("save")}).call_order("after_epoch") == ["busy", "saver"]


def test_phases_order_the_plugins_no_one_ordered_and_the_others_keep_their_places():
    preferred = ["reporter", "saver", "plain", "decider", "measurer"]
    phases = {"reporter": "report", "saver": "save", "decider": "decide", "measurer": "measure"}
    assert call_order(preferred, [], {}, {}, phases) == ["measurer", "decider", "plain", "saver", "reporter"]


def test_the_users_order_and_declared_constraints_win_over_phases():
    phases = {"a": "report", "b": "measure", "c": "save"}
    assert call_order(["a", "b", "c"], ["a", "b"], {}, {}, phases) == ["a", "b", "c"]
    assert call_order(["a", "b", "c"], [], {"a": ["b"]}, {}, phases) == ["a", "b", "c"]
    with pytest.raises(OrderError, match="form a cycle"):  # hard constraints still contradict
        call_order(["a", "b"], ["a", "b"], {"b": ["a"]}, {}, phases)


def test_one_listed_plugin_comes_first_whatever_the_phases_of_the_others():
    # `--plugins reporter`: "these first", though a report phase would place it last
    phases = {"reporter": "report", "saver": "save", "measurer": "measure"}
    preferred = ["reporter", "measurer", "saver"]
    assert call_order(preferred, ["reporter"], {}, {}, phases) == ["reporter", "measurer", "saver"]
    # an unlisted plugin's own constraint still holds: it is no contradiction of the order
    assert call_order(preferred, ["reporter"], {"saver": ["reporter"]}, {}, phases)[0] == "saver"


def test_composing_in_python_keeps_the_mappings_order():
    plugins = {"reporter": Staged("report"), "measurer": Staged("measure")}
    assert compose(plugins).call_order("after_epoch") == ["reporter", "measurer"]


def test_a_phase_that_is_not_one_is_refused_naming_the_plugin():
    with pytest.raises(
        PluginError, match=r"plugin 'odd' declares phase = 'later'; the phases, in call order: "
    ):
        compose({"odd": Staged("later")})


def test_every_declaration_has_a_default_and_a_type():
    assert set(DEFAULTS) == set(typing.get_type_hints(Declarations))
    assert PHASES == ("measure", "adjust", "decide", "save", "report")
    assert declared(object(), "rank") == "all" and declared(object(), "phase") is None
    assert declared(Staged("save"), "phase") == "save"


def test_the_standard_plugins_declare_their_phase_and_name_no_other_plugin():
    pytest.importorskip("epochal_checkpoint")
    from epochal.plugins import installed

    expected = {
        "monitor": "measure",
        "lr_scheduler": "adjust",
        "early_stopping": "decide",
        "finish_after": "decide",
        "checkpoint": "save",
        "printing": "report",
        "progress": "report",
        "sqlite_log": "report",
        "tensorboard": "report",
        "mlflow": "report",
    }
    from epochal.imports import resolve

    available = installed()
    for name, phase in expected.items():
        if name not in available:
            continue
        plugin = resolve(available[name].value, name)
        assert declared(plugin, "phase") == phase, name
        assert not declared(plugin, "run_before") and not declared(plugin, "run_after"), name


def test_a_plugin_with_state_is_stateful():
    class Counter:
        def state_dict(self):
            return {"n": 1}

        def load_state_dict(self, state):
            pass

    assert isinstance(Counter(), Stateful) and not isinstance(Staged(None), Stateful)


def test_an_autoload_declaration_that_is_not_a_bool_is_refused_not_read_as_true():
    # found by an outside plugin author: autoload = "false" autoloaded the plugin
    from epochal import load_plugins

    class Quoted:
        autoload = "false"

        @hookimpl
        def after_epoch(self, loop):
            pass

    message = r"plugin 'quoted' declares autoload = 'false'; it must be True .* or False"
    with pytest.raises(PluginError, match=message):
        load_plugins(order=["quoted"], autoload=False, extra={"quoted": Quoted})
    # a plugin given as an object is asked for, as a name in the order is (found by an
    # outside-user pass: it was left out with a warning, where a [plugins.NAME] factory stops)
    with pytest.raises(PluginError, match=message):
        load_plugins(order=[], autoload=False, extra={"quoted": Quoted})


def test_a_plugin_given_as_an_object_that_fails_to_start_is_an_error():
    from epochal import load_plugins

    class Broken:
        def __init__(self) -> None:
            raise RuntimeError("boom")

    for order in ([], ["broken"]):
        with pytest.raises(PluginError, match=r"plugin 'broken' failed to start: RuntimeError: boom"):
            load_plugins(order=order, autoload=False, extra={"broken": Broken})


@pytest.mark.parametrize("key", ["run_before", "run_after", "requires", "conflicts"])
def test_a_bare_string_for_plugin_names_is_refused_not_read_letter_by_letter(key):
    # found by an outside-user pass: run_after = "monitor" was ignored, requires = "monitor"
    # asked for plugins 'm', 'o', 'n'...
    class Declaring:
        @hookimpl
        def after_epoch(self, loop):
            pass

    setattr(Declaring, key, "monitor")
    with pytest.raises(PluginError, match=rf"plugin 'a' declares {key} = 'monitor'.*write \('monitor',\)"):
        compose({"a": Declaring(), "monitor": Staged("measure")}).check_dependencies()


class _Counted:
    """A class attribute that counts how often it is read."""

    def __init__(self, value: object) -> None:
        self.value, self.reads = value, 0

    def __get__(self, instance: object, owner: type) -> object:
        self.reads += 1
        return self.value


def test_a_plugins_declarations_are_read_once_into_one_record():
    """Loading, ordering, the dependency check, the listing and the loop read one record."""
    from epochal import Loop, load_plugins
    from epochal.examples.tiny import TinyModel, tiny_data

    counted = {
        key: _Counted(value) for key, value in (("run_after", ()), ("requires", ()), ("phase", "report"))
    }
    Plugin = type("Plugin", (), {**counted, "after_epoch": hookimpl(lambda self, loop: None)})  # noqa: N806
    plugins = load_plugins(extra={"counted": Plugin()}, autoload=False)
    plugins.check_dependencies()  # as `epochal run` does before the loop checks them again
    Loop(TinyModel(), tiny_data(), plugins=plugins, max_epochs=1, handle_signals=False).run()
    assert {key: c.reads for key, c in counted.items()} == {"run_after": 1, "requires": 1, "phase": 1}
    record = plugins.records["counted"]
    assert (record.phase, record.run_after, record.requires, record.rank) == ("report", (), (), None)
