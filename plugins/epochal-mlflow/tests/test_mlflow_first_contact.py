"""A new user's first MLflow run (issue 47): the docs' default local store, a busy machine, a
tracker that is down."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from epochal_mlflow import MLflow
from mlflow import MlflowClient

from epochal import hookimpl
from epochal.testing import TrainRecords, digits_config, epochal_command, run_loop


@pytest.mark.slow
def test_the_default_store_keeps_mlflows_info_lines_out_and_leaves_timing_records_out(tmp_path: Path) -> None:
    config = digits_config(tmp_path / "run.toml", ["monitor", "timing", "mlflow"], max_epochs=2)
    result = epochal_command("run", str(config), cwd=tmp_path, env={"EPOCHAL_DISABLE_PLUGIN_AUTOLOAD": "1"})
    assert result.returncode == 0, result.stderr
    assert "Creating initial MLflow database tables" not in result.stderr
    assert " INFO " not in result.stderr, result.stderr
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'run' / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("epochal").experiment_id])
    assert run.info.status == "FINISHED"
    assert {"train.loss", "valid.loss", "valid.accuracy"} <= set(run.data.metrics)
    assert not [key for key in run.data.metrics if key.startswith("timing.")]  # as tensorboard's default


def test_timing_records_are_sent_when_asked(tmp_path: Path) -> None:
    class Timed(TrainRecords):
        @hookimpl
        def after_epoch(self, loop: Any) -> None:
            loop.log.current_row["timing.epoch"] = 0.5

    plugin = MLflow(exclude=[], flush_every=0)
    run_loop({"train": Timed(), "mlflow": plugin}, run_dir=tmp_path / "run", max_epochs=2)
    assert plugin.finished is not None and plugin.finished.ended
    client = MlflowClient(tracking_uri=plugin.finished.spec.tracking_uri)
    assert "timing.epoch" in client.get_run(plugin.finished.mlflow_run_id).data.metrics


def test_a_slow_first_contact_with_the_local_store_loses_no_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a busy machine importing MLflow and making its tables took longer than close_timeout:
    the run ended with 0 metrics ("93 record(s) not sent"). A local store is waited for."""
    import epochal_mlflow.tracker as tracker

    made = tracker.make_store_whole

    def slow(database: Path) -> None:
        time.sleep(3)  # a busy machine
        made(database)

    monkeypatch.setattr(tracker, "make_store_whole", slow)
    plugin = MLflow(close_timeout=0.5, flush_every=0)
    result = run_loop({"train": TrainRecords(), "mlflow": plugin}, run_dir=tmp_path / "run", max_epochs=3)
    finished = plugin.finished
    assert finished is not None and finished.ended and finished.buffered == 0
    client = MlflowClient(tracking_uri=finished.spec.tracking_uri)
    history = client.get_metric_history(finished.mlflow_run_id, "train.loss")
    assert len(history) == len(result.log.history("train.loss")) > 0


def test_a_tracker_down_at_the_end_is_given_up_without_waiting_close_timeout(
    tmp_path: Path, down_uri: str
) -> None:
    plugin = MLflow(down_uri, retry_seconds=0.2, close_timeout=120)
    started = time.monotonic()
    with pytest.warns(RuntimeWarning) as caught:
        run_loop({"train": TrainRecords(), "mlflow": plugin}, run_dir=tmp_path / "run", max_epochs=3)
    took = time.monotonic() - started
    assert took < 60, took  # the whole close_timeout was waited: 120 s and more
    messages = [str(w.message) for w in caught if str(w.message).startswith("mlflow:")]
    assert any(f"the tracker at {down_uri} is down: " in m and "record(s) not sent" in m for m in messages), (
        messages
    )
