"""``epochal run`` with the mlflow plugin installed as a distribution, against a real server.

The figure this test draws from the server's metric histories is the one in
docs/plugins/mlflow.md: set ``EPOCHAL_DOCS_ASSETS=docs/assets`` to write it there.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

import pytest
from mlflow import MlflowClient

from epochal.testing import digits_config, epochal_command

ENV = {"EPOCHAL_DISABLE_PLUGIN_AUTOLOAD": "1"}


def test_digits_run_and_its_resumption_are_one_mlflow_run_with_checkpoint_and_config(
    tmp_path: Path, mlflow_server: str
) -> None:
    experiment = f"digits-{uuid.uuid4().hex[:8]}"
    config = digits_config(
        tmp_path / "digits.toml",
        ["monitor", "checkpoint", "sqlite_log", "mlflow"],
        max_epochs=3,
        extra=f'[plugins.mlflow]\ntracking_uri = "{mlflow_server}"\nexperiment = "{experiment}"\n',
    )
    first = epochal_command("run", str(config), cwd=tmp_path, env=ENV)
    assert first.returncode == 0, first.stderr
    assert first.stdout.startswith("epochal: run "), first.stdout  # nothing of MLflow's on stdout
    resumed = epochal_command(
        "run", str(config), "--resume", "--set", "loop.max_epochs=5", cwd=tmp_path, env=ENV
    )
    assert resumed.returncode == 0, resumed.stderr
    first_id, resumed_id = first.stdout.split()[2], resumed.stdout.split()[2]

    client = MlflowClient(tracking_uri=mlflow_server)
    (run,) = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    tags, params = run.data.tags, run.data.params
    assert run.info.status == "FINISHED"
    assert tags["epochal.run_id"] == resumed_id and tags["epochal.resumed_from"] == first_id
    assert (
        params["model.factory"] == "epochal.examples.digits:make_model" and params["data.batch_size"] == "64"
    )
    valid = client.get_metric_history(run.info.run_id, "valid.accuracy")
    assert sorted(m.step for m in valid) == [23 * e for e in range(1, 6)]
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"epochal", "checkpoint"} <= artifacts
    # Each run of the chain logs its final checkpoint: the first's (epoch 3) and the resumed one's.
    saved = {a.path for a in client.list_artifacts(run.info.run_id, "checkpoint")}
    latest = "checkpoint/" + os.readlink(tmp_path / "run" / "version_0" / "checkpoints" / "latest")
    assert saved == {"checkpoint/ckpt-e0003-i000069", latest} and latest.endswith("e0005-i000115")
    assert any(a.path.endswith("manifest.json") for a in client.list_artifacts(run.info.run_id, latest))

    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), dpi=100)
    for panel, metric in zip(axes, ("loss", "accuracy"), strict=True):
        for stream in ("train", "valid"):
            points = sorted(
                (m.step, m.value) for m in client.get_metric_history(run.info.run_id, f"{stream}.{metric}")
            )
            panel.plot([s for s, _ in points], [v for _, v in points], marker="o", label=f"{stream}.{metric}")
        panel.axvline(69, color="grey", linestyle=":", linewidth=1)
        panel.set_xlabel("step (iteration)")
        panel.set_ylabel(metric)
        panel.set_title(
            f"{metric}: MLflow run {run.info.run_id[:8]} (resumed at step 69), from the server", fontsize=9
        )
        panel.grid(True, alpha=0.3)
        panel.legend()
    fig.tight_layout()
    png = tmp_path / "mlflow-digits.png"
    fig.savefig(png)
    plt.close(fig)
    assert png.read_bytes()[:4] == b"\x89PNG"
    if os.environ.get("EPOCHAL_DOCS_ASSETS"):
        shutil.copy(png, Path(os.environ["EPOCHAL_DOCS_ASSETS"]) / png.name)


def test_two_processes_write_one_mlflow_run_with_the_reduced_records(
    tmp_path: Path, mlflow_server: str
) -> None:
    """``rank = "zero"``: on 2 processes only rank 0 loads the plugin; one MLflow run holds each
    epoch's record once, at the same steps as on one process."""
    experiment = f"digits2-{uuid.uuid4().hex[:8]}"
    config = digits_config(
        tmp_path / "digits.toml",
        ["monitor", "mlflow"],
        max_epochs=2,
        extra=f'[plugins.mlflow]\ntracking_uri = "{mlflow_server}"\nexperiment = "{experiment}"\n',
    )
    result = epochal_command("run", str(config), "--nproc", "2", cwd=tmp_path, env=ENV)
    assert result.returncode == 0, result.stderr
    client = MlflowClient(tracking_uri=mlflow_server)
    (run,) = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    assert run.info.status == "FINISHED"
    steps = sorted(m.step for m in client.get_metric_history(run.info.run_id, "valid.accuracy"))
    assert len(steps) == 2 and len(set(steps)) == 2, steps  # once per epoch, not once per rank


def test_a_run_killed_while_it_creates_the_default_store_leaves_no_broken_store(tmp_path: Path) -> None:
    # found by an outside-user pass: MLflow's migrations run in place, and a SIGKILL during them
    # left a mlflow.db every later run of the config failed on ("table ... already exists")
    import signal
    import subprocess
    import sys
    import time

    config = digits_config(tmp_path / "digits.toml", ["mlflow"], max_epochs=1)
    store = tmp_path / "run" / "mlflow.db"
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("EPOCHAL_")}, **ENV}
    process = subprocess.Popen(
        [sys.executable, "-m", "epochal", "run", str(config)],
        cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while not list((tmp_path / "run").glob(".mlflow.db.*.tmp")):  # the store being made
        assert process.poll() is None and time.monotonic() < deadline, "no store was being made"
        time.sleep(0.005)
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=60)
    assert not store.exists()  # never half made under its own name
    again = epochal_command("run", str(config), cwd=tmp_path, env=ENV)
    assert again.returncode == 0, again.stderr
    assert "cannot send" not in again.stderr and "already exists" not in again.stderr
    client = MlflowClient(tracking_uri=f"sqlite:///{store}")
    (run,) = client.search_runs([client.get_experiment_by_name("epochal").experiment_id])
    assert run.info.status == "FINISHED"
