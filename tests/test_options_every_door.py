"""A standard plugin's options are checked at every door, with one message.

The values below were accepted from Python and refused in TOML (issue 45): a Python constructor
now refuses them with the message a ``[plugins.NAME]`` table gets, and so do ``--set`` and a
plugin named by ``EPOCHAL_PLUGINS`` (its options from the file). The message is one line naming
the plugin, the option and the value.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from epochal import PluginError, checked_options
from epochal.cli import cli
from epochal.protocol import PositiveFloat
from epochal.testing import epochal_command

pytest.importorskip("epochal_earlystop")
pytest.importorskip("epochal_checkpoint")

#: (plugin, "module:Class", its other options, the option, a value TOML refuses, that value in TOML)
CASES: list[tuple[str, str, dict[str, Any], str, Any, str]] = [
    ("early_stopping", "epochal_earlystop:EarlyStopping", {}, "mode", "unknown_option", '"unknown_option"'),
    ("early_stopping", "epochal_earlystop:EarlyStopping", {}, "patience", -1, "-1"),
    ("early_stopping", "epochal_earlystop:EarlyStopping", {}, "min_delta", -0.5, "-0.5"),
    ("early_stopping", "epochal_earlystop:EarlyStopping", {}, "threshold_mode", "relative", '"relative"'),
    ("checkpoint", "epochal_checkpoint:Checkpoint", {}, "mode", "maximum", '"maximum"'),
    ("checkpoint", "epochal_checkpoint:Checkpoint", {}, "keep_last", -1, "-1"),
    ("finish_after", "epochal_earlystop:FinishAfter", {"epochs": 2}, "batches", 0, "0"),
    ("monitor", "epochal_monitor.plugin:Monitor", {}, "prefix", "", '""'),
]
if importlib.util.find_spec("torch") is not None:
    scheduler = {"name": "StepLR", "step_size": 2}
    CASES.append(("lr_scheduler", "epochal_schedule:LRScheduler", scheduler, "interval", "step", '"step"'))
IDS = [f"{case[0]}.{case[3]}" for case in CASES]


def construct(target: str, options: dict[str, Any]) -> Any:
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)(**options)


def from_python(target: str, others: dict[str, Any], option: str, value: Any) -> str:
    with pytest.raises(PluginError) as refused:
        construct(target, {**others, option: value})
    return str(refused.value)


def toml_value(value: Any) -> str:
    return f'"{value}"' if isinstance(value, str) else str(value)


def write_config(path: Path, plugin: str, options: dict[str, Any], autoload: bool = True) -> Path:
    table = "".join(f"{key} = {toml_value(value)}\n" for key, value in options.items())
    path.write_text(
        "[loop]\nmax_epochs = 1\n\n"
        '[model]\nfactory = "epochal.examples.tiny:TinyModel"\n\n'
        '[data]\nfactory = "epochal.examples.tiny:tiny_data"\n\n'
        f"[plugins]\nautoload = {'true' if autoload else 'false'}\n\n"
        f"[plugins.{plugin}]\n{table}",
        encoding="utf-8",
    )
    return path


def check_line(output: str, config: Path, expected: str) -> str:
    """The one line of the refusal, which must end with the Python message."""
    lines = [line for line in output.splitlines() if line.strip()]
    assert len(lines) == 1, output
    assert lines[0].endswith(expected), (lines[0], expected)
    return lines[0]


@pytest.mark.parametrize(("plugin", "target", "others", "option", "value", "spelled"), CASES, ids=IDS)
def test_python_toml_set_and_the_environment_refuse_alike(
    tmp_path, monkeypatch, plugin, target, others, option, value, spelled
):
    message = from_python(target, others, option, value)
    assert f"plugin {plugin!r}" in message and repr(option) in message and repr(value) in message
    assert "\n" not in message

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("EPOCHAL_PLUGINS", raising=False)
    monkeypatch.delenv("EPOCHAL_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    runner = CliRunner()
    # TOML: the value in the plugin's table
    config = write_config(tmp_path / "run.toml", plugin, {**others, option: value})
    done = runner.invoke(cli, ["run", str(config)])
    assert done.exit_code == 2, done.output
    assert check_line(done.output, config, message).startswith(f"Error: {config}: ")
    # --set: a valid file, the value set on the command line
    config = write_config(tmp_path / "good.toml", plugin, others)
    done = runner.invoke(cli, ["run", str(config), "--set", f"plugins.{plugin}.{option}={spelled}"])
    assert done.exit_code == 2, done.output
    assert check_line(done.output, config, message).startswith("Error: --set ")
    # EPOCHAL_PLUGINS: the plugin named by the environment in a run that autoloads nothing
    config = write_config(tmp_path / "env.toml", plugin, {**others, option: value}, autoload=False)
    monkeypatch.setenv("EPOCHAL_PLUGINS", plugin)
    done = runner.invoke(cli, ["run", str(config)])
    assert done.exit_code == 2, done.output
    check_line(done.output, config, message)


def test_a_real_process_prints_the_python_message(tmp_path):
    """The same, through ``python -m epochal`` (no traceback, status 2)."""
    message = from_python("epochal_earlystop:EarlyStopping", {}, "mode", "unknown_option")
    config = write_config(tmp_path / "run.toml", "early_stopping", {"mode": "unknown_option"})
    done = epochal_command("run", str(config), cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert check_line(done.stderr, config, message) == f"Error: {config}: {message}"


def test_valid_options_still_construct_positionally_and_by_name():
    from epochal_earlystop import EarlyStopping

    stopping = EarlyStopping("valid.accuracy", "max", 3)
    assert (stopping.monitor, stopping.mode, stopping.patience) == ("valid.accuracy", "max", 3)
    with pytest.raises(PluginError, match=r"unknown option 'patienc' .*did you mean 'patience'"):
        EarlyStopping(patienc=3)
    with pytest.raises(PluginError, match=r"option 'mode' of plugin 'early_stopping' .* not str 'maxi'"):
        EarlyStopping("valid.accuracy", "maxi")  # a positional value is checked under its name


def test_a_third_party_plugin_checks_its_options_with_the_public_decorator():
    @checked_options("loss_guard")
    class LossGuard:
        def __init__(self, limit: PositiveFloat = 1e3) -> None:
            self.limit = limit

    assert LossGuard(limit=2.0).limit == 2.0
    with pytest.raises(PluginError) as refused:
        LossGuard(limit=-1.0)
    assert str(refused.value) == (
        "[plugins.loss_guard]: option 'limit' of plugin 'loss_guard' must be greater than 0, not float -1.0"
    )

    @checked_options("make_guard")
    def make_guard(limit: PositiveFloat = 1e3) -> LossGuard:
        return LossGuard(limit)

    assert make_guard(3.0).limit == 3.0
    with pytest.raises(PluginError, match="option 'limit' of plugin 'make_guard'"):
        make_guard(0.0)
    with pytest.raises(TypeError, match="plugin's name"):
        checked_options(LossGuard)  # type: ignore[arg-type]


STANDARD = [
    "checkpoint", "load", "monitor", "progress", "printing", "timing", "early_stopping",
    "finish_after", "sqlite_log", "lr_scheduler", "tensorboard", "mlflow",
]  # fmt: skip


@pytest.mark.parametrize("plugin", STANDARD)
def test_every_standard_plugin_checks_its_options_from_python(plugin):
    """Each standard plugin's constructor refuses, from Python, a value of no annotated type for
    one of its options (an ``object()``), naming the plugin and the option, as TOML does."""
    from epochal._options import option_hints
    from epochal.discovery import installed

    entry = installed().get(plugin)
    if entry is None:
        pytest.skip(f"{plugin} is not installed")
    try:
        factory = entry.source.load()
    except ImportError as error:  # an optional dependency of the plugin (torch, say)
        pytest.skip(str(error))
    hints = option_hints(factory)
    option = next(name for name, hint in hints.items() if name != "return" and hint is not Any)
    with pytest.raises(PluginError) as refused:
        factory(**{option: object()})
    assert f"option {option!r} of plugin {plugin!r}" in str(refused.value)
