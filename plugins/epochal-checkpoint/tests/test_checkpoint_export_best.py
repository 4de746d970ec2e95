"""``epochal export --best`` (issue 29): the best checkpoint survives ``keep_last``, export says
what it wrote, and refuses with one line when the best checkpoint is gone.

The runs train the digits example for three epochs through the CLI with ``monitor =
"valid.loss"`` and ``mode = "max"``: the loss falls every epoch, so by that (odd) ranking the
first epoch is the best and ``keep_last = 1`` would otherwise prune it.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from epochal_checkpoint import list_checkpoints

from epochal.testing import digits_config, epochal_command

pytestmark = pytest.mark.slow

CHECKPOINT = '[plugins.checkpoint]\nkeep_last = 1\nmonitor = "valid.loss"\nmode = "max"\n'


def train(directory: Path, checkpoint: str, epochs: int) -> str:
    """A small digits run in *directory* with the checkpoint table *checkpoint*; its stderr."""
    digits_config(
        directory / "run.toml", ["checkpoint"], max_epochs=epochs, run_dir="run", batch_size=256, hidden=16,
        extra=checkpoint,
    )  # fmt: skip
    done = epochal_command("run", "run.toml", cwd=directory)
    assert done.returncode == 0, done.stderr
    return done.stderr


@pytest.fixture
def trained(tmp_path: Path) -> Path:
    train(tmp_path, CHECKPOINT, 3)
    return tmp_path


def test_keep_last_keeps_the_best_and_export_best_names_it(trained: Path) -> None:
    infos = list_checkpoints(trained / "run" / "version_0" / "checkpoints")[0]
    epochs = [info.manifest["epoch"] for info in infos]
    assert epochs == [1, 3]  # the best (epoch 1 by mode = "max") and the newest
    best = infos[0].manifest
    assert best["metric"] == max(info.manifest["metric"] for info in infos)

    exported = epochal_command(
        "export", "run/version_0/checkpoints", "--best", "-o", "best.safetensors", cwd=trained
    )
    assert exported.returncode == 0, exported.stderr
    line = exported.stdout.strip()
    assert f"checkpoint {Path('run/version_0/checkpoints') / infos[0].name} (epoch 1," in line
    assert f"best valid.loss={best['metric']:.6g}) to best.safetensors" in line
    assert (trained / "best.safetensors").is_file()

    newest = epochal_command("export", "run/version_0/checkpoints", "-o", "newest.safetensors", cwd=trained)
    assert newest.returncode == 0, newest.stderr
    assert f"{infos[1].name} (epoch 3, iteration {infos[1].manifest['iteration']}," in newest.stdout


def test_export_best_refuses_when_the_best_checkpoint_is_gone(trained: Path) -> None:
    directory = trained / "run" / "version_0" / "checkpoints"
    infos = list_checkpoints(directory)[0]
    shutil.rmtree(infos[0].path)  # the best, deleted by hand (or pruned by an older version)

    refused = epochal_command(
        "export", "run/version_0/checkpoints", "--best", "-o", "w.safetensors", cwd=trained
    )
    assert refused.returncode == 2, refused.stderr
    assert "Traceback" not in refused.stderr
    errors = [line for line in refused.stderr.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 1, refused.stderr
    assert "the best checkpoint of the run" in errors[0] and "(epoch 1, iteration" in errors[0]
    assert f"is gone; the best left is {infos[1].name} (epoch 3" in errors[0]
    assert not (trained / "w.safetensors").exists()


def test_a_monitor_the_run_never_logs_is_warned_about_and_export_names_it(tmp_path: Path) -> None:
    # found by an outside-user pass: a typo in monitor left no best checkpoint without a word,
    # and export --best then asked to set the monitor that was set
    stderr = train(tmp_path, CHECKPOINT.replace('monitor = "valid.loss"', 'monitor = "valid.los"'), 2)
    warned = [line for line in stderr.splitlines() if "monitored record 'valid.los'" in line]
    assert len(warned) == 1 and "(did you mean 'valid.loss'?)" in warned[0], stderr
    (checkpoints,) = list((tmp_path / "run").glob("version_*/checkpoints"))
    export = epochal_command("export", str(checkpoints), "--best", "-o", "best.safetensors", cwd=tmp_path)
    assert export.returncode == 2
    assert "a value of their monitor 'valid.los': the run's log never had that record" in export.stderr


def test_export_best_passes_over_a_damaged_best_to_its_copy(tmp_path: Path) -> None:
    # found by an outside-user pass: --resume passed over the damaged best and saved the same
    # state again as -v2; export --best still chose the damaged one and failed
    train(tmp_path, '[plugins.checkpoint]\nkeep_last = 5\nmonitor = "valid.loss"\nmode = "min"\n', 2)
    (checkpoints,) = list((tmp_path / "run").glob("version_*/checkpoints"))
    best = list_checkpoints(checkpoints)[0][-1].path  # the loss falls: the last save is the best
    data = best / "data.bin"
    data.write_bytes(data.read_bytes()[:1000])
    resumed = epochal_command("run", "run.toml", "--resume", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    copy = checkpoints / f"{best.name}-v2"
    assert copy.is_dir()
    export = epochal_command("export", str(checkpoints), "--best", "-o", "best.safetensors", cwd=tmp_path)
    assert export.returncode == 0, export.stderr
    assert f"trying its copy {copy.name}" in export.stderr
    assert copy.name in export.stdout  # it says which checkpoint it wrote
