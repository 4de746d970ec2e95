"""Installed plugins that change training run only when a run names them (issue 29; the rule of
CONTRACT.md, "Autoload"): observers autoload, deciders (early_stopping, finish_after,
lr_scheduler, load) and plugins that send data elsewhere (tensorboard, mlflow) do not. Runs of
the installed standard plugins through the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from epochal.testing import EpochalCli

pytest.importorskip("epochal_earlystop")
pytest.importorskip("epochal_checkpoint")

pytest_plugins = ["epochal.testing"]
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_epochal_env")]

# A model whose valid loss never improves: early_stopping, when it runs, stops at epoch
# 1 + patience; the Record plugin writes how many epochs ran.
FACTORIES = """
import json

from epochal import hookimpl
from epochal.testing import StubModel


def model():
    return StubModel(train={"loss": 1.0}, evaluation={"loss": 1.0})


def data():
    return {"train": [1, 2], "valid": [1]}


class Record:
    def __init__(self, path):
        self.path = path

    @hookimpl
    def after_training(self, loop):
        with open(self.path, "w") as out:
            json.dump({"epochs": loop.epoch, "reason": loop.log.status.get("finish_reason")}, out)
"""

CONFIG = """
[loop]
max_epochs = 12

[model]
factory = "factories:model"

[data]
factory = "factories:data"

[plugins]
disable = ["progress", "printing"]

[plugins.record]
factory = "factories:Record"
path = "epochs.json"
"""


def run(epochal_cli: EpochalCli, tmp_path: Path, *args: str, extra: str = "") -> dict[str, object]:
    """A CLI run of the config (every installed plugin autoloaded); what Record wrote."""
    (tmp_path / "factories.py").write_text(FACTORIES)
    (tmp_path / "run.toml").write_text(CONFIG + extra)
    (tmp_path / "epochs.json").unlink(missing_ok=True)
    result = epochal_cli("run", "run.toml", *args)
    assert result.returncode == 0, result.stderr
    recorded: dict[str, object] = json.loads((tmp_path / "epochs.json").read_text())
    return recorded


def test_early_stopping_installed_but_not_named_does_not_stop_the_run(
    tmp_path: Path, epochal_cli: EpochalCli
) -> None:
    unnamed = run(epochal_cli, tmp_path, "--set", "loop.run_dir=unnamed")
    assert unnamed["epochs"] == 12 and "early_stopping" not in str(unnamed["reason"])


def test_naming_early_stopping_makes_it_run(tmp_path: Path, epochal_cli: EpochalCli) -> None:
    # on the command line: its default options (patience 5)
    ordered = run(epochal_cli, tmp_path, "--plugins", "early_stopping", "--set", "loop.run_dir=ordered")
    assert ordered["epochs"] == 6 and str(ordered["reason"]).startswith("early_stopping:")
    # a [plugins.early_stopping] table names it too
    table = run(
        epochal_cli,
        tmp_path,
        "--set",
        "loop.run_dir=table",
        extra="\n[plugins.early_stopping]\npatience = 2\n",
    )
    assert table["epochs"] == 3 and str(table["reason"]).startswith("early_stopping:")


def test_the_listing_shows_which_plugins_load_only_when_named(
    tmp_path: Path, epochal_cli: EpochalCli
) -> None:
    listed = epochal_cli("plugins", "--json", "--no-cache")
    assert listed.returncode == 0, listed.stderr
    plugins = {p["name"]: p for p in json.loads(listed.stdout)}
    for name in ("early_stopping", "load", "finish_after", "lr_scheduler", "tensorboard", "mlflow"):
        if name in plugins and plugins[name]["error"] is None:
            assert plugins[name]["autoload"] is False and plugins[name]["status"] == "available", name
    for name in ("monitor", "checkpoint", "progress", "printing", "timing", "sqlite_log"):
        if name in plugins and plugins[name]["error"] is None:
            assert plugins[name]["autoload"] is True and plugins[name]["status"] == "loaded", name
    table = epochal_cli("plugins", "--no-cache", env={"COLUMNS": "200"})
    row = next(line for line in table.stdout.splitlines() if line.split()[:1] == ["early_stopping"])
    assert row.split()[1:4] == ["available", "when", "named"]
    (tmp_path / "factories.py").write_text(FACTORIES)
    (tmp_path / "run.toml").write_text(CONFIG + "\n[plugins.early_stopping]\npatience = 2\n")
    named = epochal_cli("plugins", "--json", "--config", "run.toml")
    assert named.returncode == 0, named.stderr
    statuses = {p["name"]: p["status"] for p in json.loads(named.stdout)}
    assert statuses["early_stopping"] == "loaded"


def test_a_table_for_a_plugin_that_autoload_false_leaves_out_is_warned_about(
    tmp_path: Path, epochal_cli: EpochalCli
) -> None:
    (tmp_path / "factories.py").write_text(FACTORIES)
    extra = "\n[plugins.early_stopping]\npatience = 2\n[plugins.checkpoint]\nkeep_last = 2\n"
    config = CONFIG.replace('disable = ["progress", "printing"]', 'order = ["record"]\nautoload = false')
    (tmp_path / "run.toml").write_text(config + extra)
    result = epochal_cli("run", "run.toml", "--set", "loop.run_dir=left_out")
    assert result.returncode == 0, result.stderr
    assert json.loads((tmp_path / "epochs.json").read_text())["epochs"] == 12  # early_stopping did not run
    for name in ("early_stopping", "checkpoint"):
        assert (
            f"run.toml: [plugins.{name}] is set, but plugin {name!r} does not run: [plugins] autoload = false"
            in result.stderr
        )
    assert "[plugins.record]" not in result.stderr  # loaded: in the order
    # --only is a choice made on the command line: no warning
    only = epochal_cli("run", "run.toml", "--only", "record", "--set", "loop.run_dir=only")
    assert only.returncode == 0, only.stderr
    assert "does not run" not in only.stderr
