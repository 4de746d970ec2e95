"""``idle_hooks``: a plugin declares hooks its configuration makes no-ops, and the loop skips them."""

from __future__ import annotations

from typing import Any

import pytest

from epochal import Loop, PluginError, hookimpl, load_plugins
from epochal.testing import StubModel


def model() -> StubModel:
    """A model whose train loss is the batch (a float)."""
    return StubModel(train=lambda batch: {"loss": float(batch)})


class Counting:
    """Counts its hook calls; *idle* is what it declares idle."""

    def __init__(self, idle: Any = None) -> None:
        if idle is not None:
            self.idle_hooks = idle
        self.calls: dict[str, int] = {}

    def _count(self, hook: str) -> None:
        self.calls[hook] = self.calls.get(hook, 0) + 1

    @hookimpl
    def after_batch(self) -> None:
        self._count("after_batch")

    @hookimpl
    def after_epoch(self) -> None:
        self._count("after_epoch")


class Wrapping:
    """A new-style wrapper around ``after_batch``: the hook then goes through pluggy."""

    def __init__(self) -> None:
        self.calls = 0

    @hookimpl(wrapper=True)
    def after_batch(self) -> Any:
        self.calls += 1
        return (yield)


def run(plugins: dict[str, object]) -> Loop:
    loop = Loop(
        model(),
        {"train": [1.0, 2.0, 3.0]},
        plugins=plugins,
        max_epochs=2,
        handle_signals=False,
    )
    loop.run()
    return loop


def test_an_idle_hook_is_not_called_and_the_others_are() -> None:
    idle, busy = Counting(idle={"after_batch"}), Counting()
    loop = run({"idle": idle, "busy": busy})
    assert idle.calls == {"after_epoch": 2}
    assert busy.calls == {"after_batch": 6, "after_epoch": 2}
    assert loop.plugin_set.implements("after_batch")


def test_a_hook_every_plugin_declares_idle_has_no_caller() -> None:
    loop = run({"idle": Counting(idle=frozenset({"after_batch"}))})
    assert not loop.plugin_set.implements("after_batch")
    assert loop.plugin_set.implements("after_epoch")


def test_with_a_wrapper_on_the_hook_pluggy_calls_everything() -> None:
    idle, wrapper = Counting(idle=["after_batch"]), Wrapping()
    run({"idle": idle, "wrapper": wrapper})
    assert wrapper.calls == 6
    assert idle.calls["after_batch"] == 6  # through pluggy: a no-op call, but no error


@pytest.mark.parametrize(
    ("declared", "message"),
    [
        ("after_batch", r"plugin 'idle' declares idle_hooks = 'after_batch'; it must be a set of hook names"),
        (True, r"plugin 'idle' declares idle_hooks = True"),
        ({"after_bach"}, r"idle_hooks \['after_bach'\] that are not hooks \(did you mean 'after_batch'\?\)"),
    ],
)
def test_a_bad_declaration_is_one_error_naming_the_plugin(declared: Any, message: str) -> None:
    with pytest.raises(PluginError, match=message):
        run({"idle": Counting(idle=declared)})


def test_checkpoint_declares_after_batch_idle_only_when_no_save_can_come_due_there(tmp_path: Any) -> None:
    def checkpoint(**options: Any) -> Any:
        plugins = load_plugins(order=["checkpoint"], autoload=False, options={"checkpoint": options})
        return plugins.plugins["checkpoint"]

    assert checkpoint().idle_hooks == {"after_batch"}
    for options in ({"every_n_batches": 2}, {"every_n_seconds": 1.0}, {"async_save": True}):
        assert checkpoint(**options).idle_hooks == frozenset(), options
    # and its batch saves still happen
    plugins = load_plugins(
        order=["checkpoint"], autoload=False, options={"checkpoint": {"every_n_batches": 2}}
    )
    loop = Loop(
        model(),
        {"train": [1.0, 2.0, 3.0, 4.0]},
        plugins=plugins,
        max_epochs=1,
        run_dir=tmp_path,
        handle_signals=False,
    )
    loop.run()
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith("ckpt-"))
    assert names == ["ckpt-e0000-i000002", "ckpt-e0000-i000004", "ckpt-e0001-i000004"], names


def test_a_composite_child_declares_its_own_idle_hooks() -> None:
    from epochal import CompositePlugin

    idle, busy = Counting(idle={"after_batch"}), Counting()
    run({"both": CompositePlugin({"idle": idle, "busy": busy})})
    assert idle.calls == {"after_epoch": 2}
    assert busy.calls == {"after_batch": 6, "after_epoch": 2}
