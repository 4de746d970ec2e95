"""A plugin replaces a standard one by declaration (issue 45, item 3): ``provides = "checkpoint"``.

Of two plugins that provide one name, one runs: the one the run names, else the one that
declares it provides the name (installed to replace the standard plugin). What the CLI says
about checkpoints and ``--profile``'s timing table follow the declaration, not the name.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from epochal import PluginError, hookimpl, load_plugins
from epochal.testing import epochal_command

pytestmark = pytest.mark.usefixtures("no_epochal_env")
pytest_plugins = ["epochal.testing"]


class Saver:
    """A checkpoint plugin of the user's own (it saves nothing: what matters is its declaration)."""

    provides = "checkpoint"

    @hookimpl
    def resume_state(self, loop, resume):
        return None


def test_a_named_provider_replaces_the_autoloaded_standard_plugin():
    pytest.importorskip("epochal_checkpoint")
    plugins = load_plugins(extra={"saver": Saver()}, disable=["progress", "printing"])
    assert "saver" in plugins.plugins and "checkpoint" not in plugins.plugins
    info = next(i for i in plugins.infos if i.name == "checkpoint")
    assert (
        info.status == "replaced" and info.error == "replaced by plugin 'saver', which provides 'checkpoint'"
    )
    assert plugins.provider("checkpoint") == "saver"
    assert plugins.call_order("resume_state") == ["saver"]  # one saver: --resume cannot disagree


def test_the_standard_plugin_named_by_the_run_wins_and_two_named_are_one_error():
    pytest.importorskip("epochal_checkpoint")
    plugins = load_plugins(order=["checkpoint"], autoload=False)
    assert plugins.provider("checkpoint") == "checkpoint"
    with pytest.raises(
        PluginError, match=r"plugins 'checkpoint' and 'saver' each provide 'checkpoint': one runs"
    ):
        load_plugins(order=["checkpoint"], extra={"saver": Saver()})


PROVIDERS = """
from epochal import hookimpl


class Saver:
    provides = "checkpoint"

    @hookimpl
    def resume_state(self, loop, resume):
        return None
"""


@pytest.fixture(scope="module")
def two_providers(tmp_path_factory: pytest.TempPathFactory, pip_install_target: Any) -> Path:
    root = tmp_path_factory.mktemp("providers")
    (root / "src" / "epochal_providers").mkdir(parents=True)
    (root / "src" / "epochal_providers" / "__init__.py").write_text(PROVIDERS)
    (root / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools>=61"]\nbuild-backend = "setuptools.build_meta"\n\n'
        '[project]\nname = "epochal-providers"\nversion = "0.1.0"\n\n'
        '[project.entry-points."epochal.plugins"]\n'
        'saver_a = "epochal_providers:Saver"\nsaver_b = "epochal_providers:Saver"\n'
    )
    pip_install_target(root, root / "site")
    return root / "site"


@pytest.mark.slow
def test_two_installed_providers_none_named_none_runs_and_the_listing_says_why(two_providers, tmp_path):
    pytest.importorskip("epochal_checkpoint")
    env = {"PYTHONPATH": str(two_providers)}
    listing = epochal_command("plugins", "--json", "--no-cache", cwd=tmp_path, env=env)
    assert listing.returncode == 0, listing.stderr
    found = {p["name"]: p for p in json.loads(listing.stdout)}
    assert (
        found["saver_a"]["status"]
        == found["saver_b"]["status"]
        == found["checkpoint"]["status"]
        == "conflict"
    )
    assert "plugins 'saver_a' and 'saver_b' each provide 'checkpoint'" in found["saver_a"]["error"]
    chosen = epochal_command("plugins", "--json", "--plugins", "saver_b", cwd=tmp_path, env=env)
    found = {p["name"]: p for p in json.loads(chosen.stdout)}
    assert found["saver_b"]["status"] == "loaded"
    assert found["saver_a"]["status"] == found["checkpoint"]["status"] == "replaced"


def test_a_bad_provides_is_refused_naming_the_plugin():
    class Odd:
        provides = 3

        @hookimpl
        def after_epoch(self, loop):
            pass

    with pytest.raises(PluginError, match=r"plugin 'odd' declares provides = 3; it must be a plugin name"):
        load_plugins(extra={"odd": Odd()}, autoload=False)


FACTORIES = """
import os
import signal
import sys

from epochal import hookimpl
from epochal.testing import StubModel


def model():
    return StubModel(train={"loss": 1.0}, evaluation={"loss": 1.0})


def data():
    return {"train": [1, 2, 3, 4], "valid": [1]}


class Saver:
    provides = "checkpoint"

    def __init__(self, keep: int = 1):
        self.keep = keep

    @hookimpl
    def after_batch(self, loop):
        if loop.iteration == 2:
            os.kill(os.getpid(), signal.SIGTERM)

    @hookimpl
    def on_interrupt(self, loop):
        pass

    @hookimpl
    def after_training(self, loop):
        for _ in range(3):
            os.kill(os.getpid(), signal.SIGINT)


class Timer:
    provides = "timing"

    def __init__(self, table: bool = False):
        self.table = table

    @hookimpl
    def after_training(self, loop):
        if self.table:
            print("my timing table", file=sys.stderr)
"""

CONFIG = """
[loop]
max_epochs = 2

[model]
factory = "factories:model"

[data]
factory = "factories:data"

[plugins]
disable = ["progress", "printing", "sqlite_log"]
"""


def test_the_cli_names_the_provider_test_weights_and_a_third_sigint(tmp_path):
    pytest.importorskip("epochal_checkpoint")
    (tmp_path / "factories.py").write_text(FACTORIES)
    (tmp_path / "run.toml").write_text(
        CONFIG.replace("max_epochs = 2", 'max_epochs = 2\ntest_streams = ["valid"]\ntest_weights = "best"')
        + '\n[plugins.saver]\nfactory = "factories:Saver"\n'
    )
    best = epochal_command("run", "run.toml", cwd=tmp_path)
    assert best.returncode == 2, best.stderr
    assert "plugin 'saver' saves this run's checkpoints and tracks none: make it track one" in best.stderr
    assert "[plugins.checkpoint]" not in best.stderr
    (tmp_path / "run.toml").write_text(CONFIG + '\n[plugins.saver]\nfactory = "factories:Saver"\n')
    stopped = epochal_command("run", "run.toml", cwd=tmp_path)
    assert stopped.returncode == 130, stopped.stderr
    assert "plugin 'saver' saves an interrupt checkpoint there" in stopped.stderr


def test_profile_asks_the_plugin_that_provides_timing(tmp_path):
    pytest.importorskip("epochal_timing")
    (tmp_path / "factories.py").write_text(FACTORIES)
    (tmp_path / "run.toml").write_text(CONFIG + '\n[plugins.timer]\nfactory = "factories:Timer"\n')
    profiled = epochal_command("run", "run.toml", "--profile", cwd=tmp_path)
    assert profiled.returncode == 0, profiled.stderr
    assert "my timing table" in profiled.stderr
    assert "plugin" not in profiled.stderr.replace("my timing table", "")  # no other timing ran
