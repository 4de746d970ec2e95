"""The run-level hooks: ``run_summary``, ``check_fresh_run`` and ``latest_checkpoint``.

What a plugin adds to the summary, how the CLI refuses a fresh run, and the launcher's question
after a rank died, including the plugins that answer badly.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from epochal import hookimpl
from epochal.errors import ConfigError, PluginError
from epochal.plugins import compose
from epochal.run_hooks import latest_checkpoint, refuse_fresh_run

PLUGINS = """
from epochal import hookimpl


class Says:
    def __init__(self, line="hello"):
        self.line = line

    @hookimpl
    def run_summary(self, loop):
        return [f"{self.line} after {loop.epoch} epoch(s)", " ".join(loop.command)]


class Raises:
    @hookimpl
    def run_summary(self, loop):
        raise RuntimeError("no summary today")


class NotStrings:
    @hookimpl
    def run_summary(self, loop):
        return [1, 2]
"""


def run_config(tmp_path: Path, order: list[str]) -> subprocess.CompletedProcess[str]:
    (tmp_path / "mine.py").write_text(PLUGINS)
    tables = "".join(f'\n[plugins.{name}]\nfactory = "mine:{cls}"\n' for name, cls in order_classes(order))
    (tmp_path / "run.toml").write_text(
        f"""[loop]
max_epochs = 2

[model]
factory = "epochal.examples.tiny:TinyModel"

[data]
factory = "epochal.examples.tiny:tiny_data"

[plugins]
order = {[name for name, _ in order_classes(order)]!r}
autoload = false
{tables}"""
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPOCHAL_")}
    return subprocess.run(
        [sys.executable, "-m", "epochal", "run", "run.toml", "--set", "loop.seed=3"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def order_classes(order: list[str]) -> list[tuple[str, str]]:
    return [(name.lower(), name) for name in order]


@pytest.mark.slow
def test_each_plugin_adds_its_lines_and_a_bad_one_costs_only_its_own(tmp_path):
    done = run_config(tmp_path, ["Raises", "Says", "NotStrings"])
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "epochal: hello after 2 epoch(s)" in lines
    # loop.command after training: the command that, with --resume, trains on (max_epochs = 2 reached)
    assert "epochal: epochal run run.toml --set loop.seed=3 --set loop.max_epochs=4" in lines
    assert "finished after 2 epoch(s)" in lines[0]
    warnings = [line for line in done.stderr.splitlines() if "run_summary" in line]
    assert len(warnings) == 2, done.stderr
    assert "plugin 'raises' raised in run_summary: RuntimeError: no summary today" in warnings[0]
    assert "plugin 'notstrings': run_summary must return a list of strings" in warnings[1]
    assert "Traceback" not in done.stderr


class Latest:
    def __init__(self, path: str | None) -> None:
        self.path = path

    @hookimpl
    def latest_checkpoint(self, run_dir):
        return None if self.path is None else f"{run_dir}/{self.path}"


class Refuses:
    @hookimpl
    def check_fresh_run(self, run_dir, command):
        return f"{run_dir} is taken; {' '.join([*command, '--resume'])}"


def test_latest_checkpoint_is_the_plugins_answer():
    plugins = compose({"a": Latest(None), "b": Latest("ckpt-2")})
    assert latest_checkpoint(plugins.pm, "run") == "run/ckpt-2"
    assert latest_checkpoint(compose({"a": Latest(None)}).pm, "run") is None
    agreeing = compose({"a": Latest("ckpt-2"), "b": Latest("ckpt-2")})
    assert latest_checkpoint(agreeing.pm, "run") == "run/ckpt-2"


def test_two_plugins_naming_different_checkpoints_is_one_error_naming_both():
    plugins = compose({"a": Latest("ckpt-1"), "b": Latest("ckpt-2")})
    with pytest.raises(PluginError) as raised:
        latest_checkpoint(plugins.pm, "run")
    message = str(raised.value)
    assert "plugin 'a' says run/ckpt-1" in message and "plugin 'b' says run/ckpt-2" in message
    assert "\n" not in message


def test_a_refusal_of_a_fresh_run_is_a_config_error_with_the_plugins_message():
    refuse_fresh_run(compose({"a": Latest(None)}).pm, "run", ["epochal", "run", "x.toml"])  # no one refuses
    with pytest.raises(ConfigError, match=r"^run is taken; epochal run x.toml --resume$"):
        refuse_fresh_run(compose({"r": Refuses()}).pm, "run", ["epochal", "run", "x.toml"])
