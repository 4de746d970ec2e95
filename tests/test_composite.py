"""``epochal.CompositePlugin``: several plugins ordered, disabled and named as one unit."""

from __future__ import annotations

import pytest

from epochal import CompositePlugin, hookimpl
from epochal.plugins import compose


class Named:
    def __init__(self, name: str, calls: list[str]) -> None:
        self.name, self.calls = name, calls

    @hookimpl
    def before_training(self, loop):
        self.calls.append(self.name)


def test_children_run_together_at_the_composites_place_named_parent_slash_child():
    calls: list[str] = []
    bundle = CompositePlugin({"one": Named("one", calls), "two": Named("two", calls)})
    plugins = compose({"first": Named("first", calls), "bundle": bundle, "last": Named("last", calls)})
    assert plugins.call_order("before_training") == ["first", "bundle/one", "bundle/two", "last"]
    assert "bundle/two" in plugins.plugins


def test_one_child_can_be_left_out():
    calls: list[str] = []
    bundle = CompositePlugin({"one": Named("one", calls), "two": Named("two", calls)})
    plugins = compose({"bundle": bundle}, disable=["bundle/one"])
    assert plugins.call_order("before_training") == ["bundle/two"]


@pytest.mark.parametrize("name", ["", "a/b"])
def test_a_child_name_must_be_a_plain_name(name):
    with pytest.raises(ValueError, match="invalid child plugin name"):
        CompositePlugin({name: object()})


class Counted(Named):
    """A child with a state: a composite's children are saved and resumed, nested ones too."""

    def __init__(self, name: str, calls: list[str]) -> None:
        super().__init__(name, calls)
        self.n = 0

    @hookimpl
    def after_epoch(self, loop):
        self.n += 1

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, state):
        self.n = state["n"]


def test_a_composite_inside_a_composite_expands_its_children_too():
    from epochal import Loop
    from epochal.examples.tiny import TinyModel, tiny_data

    calls: list[str] = []
    inner = CompositePlugin({"x": Counted("x", calls), "y": Counted("y", calls)})
    outer = CompositePlugin({"a": Counted("a", calls), "inner": inner})
    plugins = compose({"first": Named("first", calls), "outer": outer}, disable=["outer/inner/y"])
    assert plugins.call_order("before_training") == ["first", "outer/a", "outer/inner/x"]
    loop = Loop(TinyModel(), tiny_data(), plugins=plugins, max_epochs=2, handle_signals=False)
    loop.run()
    assert loop.state_dict()["plugins"]["outer/inner/x"]["state"] == {"n": 2}
    assert "outer/inner/y" not in loop.plugins


@pytest.mark.parametrize(
    ("name", "plugin", "message"),
    [
        ("c", Named, r"plugin 'c' is the class Named, not a plugin object: give an instance \(Named\(\)\)"),
        ("x", None, r"plugin 'x' is None, not a plugin object"),
        ("x", "abc", r"plugin 'x' is 'abc', not a plugin object"),
        ("a/b", object(), r"invalid plugin name 'a/b'"),
        ("", object(), r"invalid plugin name ''"),
    ],
)
def test_what_cannot_be_a_plugin_is_refused_naming_it(name, plugin, message):
    # found by an outside-user pass: a class failed at the first hook, None ran as no plugin
    from epochal.errors import PluginError

    with pytest.raises(PluginError, match=message):
        compose({name: plugin})
