"""The summary of ``epochal run`` names every file a run leaves for a person (issue 47): the
exported weights, the TensorBoard directory, the MLflow store and run; exported files follow
the umask, as every other file of the run."""

from __future__ import annotations

import os
import shlex
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from epochal.testing import digits_config

pytest.importorskip("epochal_checkpoint")
pytest.importorskip("epochal_tensorboard")
pytest.importorskip("epochal_mlflow")
pytest.importorskip("mlflow")
pytest.importorskip("tensorboard")


@pytest.mark.slow
def test_the_summary_names_the_exports_tensorboard_and_mlflow_and_exports_follow_the_umask(
    tmp_path: Path,
) -> None:
    extra = '[plugins.checkpoint]\nexport = "both"\nmonitor = "valid.loss"\n'
    plugins = ["monitor", "checkpoint", "tensorboard", "mlflow"]
    config = digits_config(tmp_path / "run.toml", plugins, run_dir="runs/digits", extra=extra)
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPOCHAL_") and k != "COLUMNS"}
    command = shlex.join([sys.executable, "-m", "epochal", "run", str(config)])
    result = subprocess.run(
        ["sh", "-c", f"umask 027 && exec {command}"], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    lines = result.stdout.replace(" \\\n    ", " ").replace("\n    ", " ").splitlines()  # lines unwrapped
    checkpoints = tmp_path / "runs/digits/version_0/checkpoints"
    best, last = checkpoints / "best.safetensors", checkpoints / "last.safetensors"
    assert f"epochal: weights: {best.relative_to(tmp_path)}, {last.relative_to(tmp_path)}" in lines
    board = tmp_path / "runs/digits/version_0/tensorboard"
    assert f"epochal: tensorboard: tensorboard --logdir {board.relative_to(tmp_path)}" in lines
    assert any(board.glob("events.out.tfevents.*"))
    store = f"sqlite:///{tmp_path.resolve() / 'runs/digits/mlflow.db'}"
    run = next(line for line in lines if line.startswith("epochal: mlflow: run "))
    assert run.endswith(f"(experiment 'epochal') in {store}"), run
    assert f"epochal: mlflow ui: mlflow ui --backend-store-uri {store}" in lines
    from mlflow import MlflowClient

    mlflow_run = MlflowClient(tracking_uri=store).get_run(run.split()[3])
    assert mlflow_run.data.metrics["valid.loss"] > 0
    for exported in (best, last):  # 0600 before: teammates could not read them
        assert stat.S_IMODE(exported.stat().st_mode) == 0o640, oct(exported.stat().st_mode)
