"""The composite example, installed as a distribution, through the `epochal` CLI."""

from __future__ import annotations

import json
from pathlib import Path

from epochal.testing import EpochalCli

pytest_plugins = ["epochal.testing"]

CONFIG = """
[loop]
max_epochs = 30
seed = 0

[model]
factory = "epochal.examples.digits:make_model"
lr = 2.0

[data]
factory = "epochal.examples.digits:make_data"
batch_size = 128

[plugins]
order = ["guarded"]
autoload = false

[plugins.guarded]
metric = "valid.accuracy"
mode = "max"
patience = 2
dir = "ckpt"
"""


def test_children_are_listed_and_ordered_as_one_unit(tmp_path: Path, epochal_cli: EpochalCli) -> None:
    (tmp_path / "run.toml").write_text(CONFIG)
    result = epochal_cli("plugins", "--json", "--config", "run.toml")
    assert result.returncode == 0, result.stderr
    loaded = {p["name"]: p for p in json.loads(result.stdout) if p["status"] == "loaded"}
    assert list(loaded) == ["guarded/monitor", "guarded/stop", "guarded/save"]
    assert all(p["parent"] == "guarded" for p in loaded.values())
    assert all(p["distribution"] == "epochal-guarded" for p in loaded.values())


def test_shared_options_configure_every_child(tmp_path: Path, epochal_cli: EpochalCli) -> None:
    (tmp_path / "run.toml").write_text(CONFIG)
    result = epochal_cli("run", "run.toml")
    assert result.returncode == 0, result.stderr
    assert "early_stopping: valid.accuracy" in result.stdout  # stopped by guarded/stop on the shared metric
    manifests = sorted((tmp_path / "ckpt").glob("*/manifest.json"))
    assert manifests, "guarded/save wrote no checkpoint"


def test_a_child_can_be_disabled_alone(tmp_path: Path, epochal_cli: EpochalCli) -> None:
    (tmp_path / "run.toml").write_text(CONFIG.replace("max_epochs = 30", "max_epochs = 2"))
    result = epochal_cli("run", "run.toml", "--disable", "guarded/save")
    assert result.returncode == 0, result.stderr
    assert not (tmp_path / "ckpt").exists()


def test_it_is_not_autoloaded(epochal_cli: EpochalCli) -> None:
    result = epochal_cli("plugins", "--json")
    statuses = {p["name"]: p["status"] for p in json.loads(result.stdout)}
    assert statuses["guarded"] == "available"


def test_beside_the_standard_checkpoint_in_one_directory_it_names_both(
    tmp_path: Path, epochal_cli: EpochalCli
) -> None:
    config = CONFIG.replace('order = ["guarded"]', 'order = ["guarded", "checkpoint"]').replace(
        'dir = "ckpt"\n', ""
    )
    (tmp_path / "run.toml").write_text(config.replace("max_epochs = 30", "max_epochs = 2"))
    result = epochal_cli("run", "run.toml")
    assert result.returncode == 2, result.stderr
    assert "is written by two plugins of this run, 'guarded/save' and 'checkpoint'" in result.stderr
    assert "--disable checkpoint" in result.stderr


def test_the_readmes_example_runs(tmp_path: Path, epochal_cli: EpochalCli) -> None:
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    example = readme.split("```toml\n", 1)[1].split("```", 1)[0]
    head = CONFIG.split("[plugins]")[0].replace("max_epochs = 30", "max_epochs = 2")
    (tmp_path / "run.toml").write_text(head + example)
    result = epochal_cli("run", "run.toml")
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in (tmp_path / "runs" / "digits" / "guarded").glob("ckpt-*"))
