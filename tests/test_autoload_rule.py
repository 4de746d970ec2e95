"""The autoload rule is checkable (issue 45): a plugin that decides declares ``autoload = False``.

Installed, a plugin that autoloads runs in every run of every configuration, so one that
changes what is trained must say ``autoload = False``. What its declarations show (a phase
``adjust`` or ``decide``) is checked when plugins load, so ``epochal plugins --check`` and every
run leave such a plugin out unless the run names it; what only running it shows (a guard
without a phase that calls ``loop.request_stop``) ``epochal.testing.check_autoload_rule`` finds,
and the scaffold's generated tests call it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

from epochal import hookimpl
from epochal.testing import check_autoload_rule, epochal_command

PLUGINS = '''
from epochal import hookimpl


class Decider:
    """Says it decides, and forgets autoload = False."""

    phase = "decide"

    @hookimpl
    def after_epoch(self, loop):
        loop.request_stop("decider: enough")


class Watcher:
    phase = "measure"

    @hookimpl
    def after_epoch(self, loop):
        loop.log.current_row["watched"] = 1
'''

PYPROJECT = """
[build-system]
requires = ["setuptools>=61"]
build-backend = "setuptools.build_meta"

[project]
name = "epochal-rulebreaker"
version = "0.1.0"

[project.entry-points."epochal.plugins"]
rb_decider = "epochal_rulebreaker:Decider"
rb_watcher = "epochal_rulebreaker:Watcher"
"""

CONFIG = """
[loop]
max_epochs = 3

[model]
factory = "epochal.examples.tiny:TinyModel"

[data]
factory = "epochal.examples.tiny:tiny_data"

[plugins]
disable = ["progress", "printing", "timing", "sqlite_log", "checkpoint"]
"""


@pytest.fixture(scope="module")
def rulebreaker(tmp_path_factory: pytest.TempPathFactory, pip_install_target: Any) -> dict[str, str]:
    root = tmp_path_factory.mktemp("rulebreaker")
    (root / "src" / "epochal_rulebreaker").mkdir(parents=True)
    (root / "src" / "epochal_rulebreaker" / "__init__.py").write_text(PLUGINS)
    (root / "pyproject.toml").write_text(PYPROJECT)
    pip_install_target(root, root / "site")
    return {"PYTHONPATH": str(root / "site")}


@pytest.mark.slow
def test_a_decider_that_autoloads_is_left_out_unless_named(rulebreaker, tmp_path):
    (tmp_path / "run.toml").write_text(CONFIG)
    checked = epochal_command("plugins", "--check", "run.toml", cwd=tmp_path, env=rulebreaker)
    assert checked.returncode == 0, checked.stderr
    assert "rb_watcher" in checked.stdout and "rb_decider" not in checked.stdout
    assert "plugin 'rb_decider' declares phase = 'decide'" in checked.stderr
    assert "autoload = False" in checked.stderr
    listing = json.loads(epochal_command("plugins", "--json", cwd=tmp_path, env=rulebreaker).stdout)
    decider = next(p for p in listing if p["name"] == "rb_decider")
    assert decider["status"] == "failed" and "the autoload rule" in decider["error"]
    ran = epochal_command("run", "run.toml", cwd=tmp_path, env=rulebreaker)
    assert ran.returncode == 0, ran.stderr
    assert "finished after 3 epoch(s)" in ran.stdout  # installing it changed nothing
    named = epochal_command("run", "run.toml", "--plugins", "rb_decider", cwd=tmp_path, env=rulebreaker)
    assert named.returncode == 0, named.stderr
    assert "finished after 1 epoch(s)" in named.stdout  # named, it runs and decides


class Guard:
    """The docs' guard without its declaration: it stops the run but autoloads."""

    def __init__(self, limit: float = 1e3) -> None:
        self.limit = limit

    @hookimpl
    def after_batch(self, loop: Any, outputs: Any) -> None:
        if outputs["loss"] > self.limit:
            loop.request_stop("guard: loss too high")


class Slower:
    @hookimpl
    def after_epoch(self, loop: Any) -> None:
        loop.model.lr *= 0.5


class Recorder:
    @hookimpl
    def after_epoch(self, loop: Any) -> None:
        loop.log.current_row["seen"] = loop.epoch


def test_check_autoload_rule_finds_what_running_shows():
    with pytest.raises(AssertionError, match=r"plugin 'guard' changes what is trained \(training ended"):
        check_autoload_rule(Guard(limit=0.0), "guard")
    with pytest.raises(AssertionError, match=r"plugin 'slower' changes what is trained \(the model's final"):
        check_autoload_rule(Slower(), "slower")
    check_autoload_rule(Guard(), "guard")  # it does not act: nothing to see
    check_autoload_rule(Recorder(), "recorder")  # a record changes no training

    class Declared(Guard):
        autoload = False

    check_autoload_rule(Declared(limit=0.0), "guard")

    class Phased(Recorder):
        phase = "adjust"

    with pytest.raises(AssertionError, match="declares phase = 'adjust'"):
        check_autoload_rule(Phased(), "phased")


def test_every_standard_decider_keeps_the_rule():
    earlystop = pytest.importorskip("epochal_earlystop")
    check_autoload_rule(
        earlystop.EarlyStopping(monitor="valid.loss", patience=0, min_delta=1e9), "early_stopping"
    )
    check_autoload_rule(earlystop.FinishAfter(batches=2), "finish_after")


@pytest.mark.slow
def test_the_scaffolds_generated_test_catches_a_guard_without_its_declaration(tmp_path):
    """``epochal new-plugin`` writes a test calling check_autoload_rule: it passes for the
    scaffold's counter and fails once the plugin stops runs without ``autoload = False``."""
    made = epochal_command("new-plugin", "loss_guard", "--dir", "out", cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    root = tmp_path / "out" / "epochal-loss-guard"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "src"), os.environ.get("PYTHONPATH", "")])}

    def generated_tests() -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "autoload", "tests"],
            cwd=root,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )

    passed = generated_tests()
    assert passed.returncode == 0, passed.stdout + passed.stderr
    plugin = root / "src" / "epochal_loss_guard" / "plugin.py"
    source = plugin.read_text()
    stops = "        self.batches += 1\n"
    assert stops in source
    plugin.write_text(
        source.replace(stops, stops + '        loop.request_stop("too many batches")\n').replace(
            "    def after_batch(self) -> None:", "    def after_batch(self, loop: Any) -> None:"
        )
    )
    failed = generated_tests()
    assert failed.returncode == 1, failed.stdout + failed.stderr
    assert "plugin 'loss_guard' changes what is trained" in failed.stdout
