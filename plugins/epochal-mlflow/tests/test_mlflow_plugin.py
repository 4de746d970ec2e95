"""The mlflow plugin against a real ``mlflow server``, queried with MLflow's own client."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from epochal_mlflow import MLflow
from epochal_sqlite import Reader, SQLiteLog
from mlflow import MlflowClient

from epochal import PluginError, hookimpl, load_plugins
from epochal.records import number
from epochal.testing import ResumeFrom, SaveAt, TrainRecords, run_loop


def history(client: MlflowClient, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def expected(log: Any, key: str, upto: int | None = None, after: int | None = None) -> list[tuple[int, Any]]:
    return [
        (i, pytest.approx(float(v)))
        for i, v in log.history(key)
        if number(v) is not None and (upto is None or i <= upto) and (after is None or i > after)
    ]


def only_run(client: MlflowClient, experiment: str) -> Any:
    found = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    assert len(found) == 1, [r.info.run_id for r in found]
    return found[0]


def test_a_run_is_an_mlflow_run_with_params_metrics_tags_and_config(
    tmp_path: Path, mlflow_server: str
) -> None:
    experiment = f"e-{uuid.uuid4().hex[:8]}"
    config = {"model": {"lr": 0.05, "factory": "x:y"}, "loop": {"max_epochs": 3}}
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    (tmp_path / "run" / "checkpoints" / "model.safetensors").write_bytes(b"weights")
    plugin = MLflow(tracking_uri=mlflow_server, experiment=experiment, flush_every=2)
    result = run_loop(
        {"train": TrainRecords(), "mlflow": plugin}, run_dir=tmp_path / "run", max_epochs=3, config=config
    )
    client = MlflowClient(tracking_uri=mlflow_server)
    run = only_run(client, experiment)
    assert run.info.status == "FINISHED"
    assert run.data.tags["epochal.run_id"] == result.loop.run_id
    assert "epochal.resumed_from" not in run.data.tags
    assert run.data.params == {"model.lr": "0.05", "model.factory": "x:y", "loop.max_epochs": "3"}
    keys = {k for _, row in result.log.rows() for k, v in row.items() if number(v) is not None}
    assert {"train.loss", "valid.loss"} <= keys == set(run.data.metrics)
    for key in keys:
        assert history(client, run.info.run_id, key) == expected(result.log, key), key
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id, "epochal")}
    assert artifacts == {"epochal/config.json"}
    local = client.download_artifacts(run.info.run_id, "epochal/config.json", str(tmp_path))
    import json

    assert json.loads(Path(local).read_text()) == config
    weights = client.download_artifacts(run.info.run_id, "weights/model.safetensors", str(tmp_path))
    assert Path(weights).read_bytes() == b"weights"
    assert plugin.finished is not None and plugin.finished.dropped == 0


def test_a_resumed_run_continues_the_same_mlflow_run(tmp_path: Path, mlflow_server: str) -> None:
    experiment = f"e-{uuid.uuid4().hex[:8]}"
    saver = SaveAt(2)
    first = run_loop(
        {"train": TrainRecords(), "mlflow": MLflow(mlflow_server, experiment), "saver": saver},
        run_dir=tmp_path / "run",
        max_epochs=2,
    )
    assert saver.state is not None
    client = MlflowClient(tracking_uri=mlflow_server)
    before = only_run(client, experiment)
    second = run_loop(
        {
            "train": TrainRecords(),
            "mlflow": MLflow(mlflow_server, experiment),
            "resume": ResumeFrom(saver.state),
        },
        run_dir=tmp_path / "run",
        max_epochs=4,
    )
    run = only_run(client, experiment)
    assert run.info.run_id == before.info.run_id
    assert run.info.status == "FINISHED"
    assert run.data.tags["epochal.run_id"] == second.loop.run_id
    assert run.data.tags["epochal.resumed_from"] == first.loop.run_id
    assert run.data.tags["epochal.runs"] == f"{first.loop.run_id} {second.loop.run_id}"
    assert history(client, run.info.run_id, "train.loss") == expected(second.log, "train.loss")


def test_resume_from_an_earlier_state_starts_a_continuing_run_without_the_superseded_steps(
    tmp_path: Path, mlflow_server: str
) -> None:
    """Run A saves after epoch 1 and goes on to epoch 3; run B resumes from epoch 1."""
    experiment = f"e-{uuid.uuid4().hex[:8]}"
    saver = SaveAt(1)
    first = run_loop(
        {"train": TrainRecords(), "mlflow": MLflow(mlflow_server, experiment), "saver": saver},
        run_dir=tmp_path / "run",
        max_epochs=3,
        seed=0,
    )
    assert saver.state is not None
    restored = saver.state["iteration"]
    second = run_loop(
        {
            "train": TrainRecords(),
            "mlflow": MLflow(mlflow_server, experiment),
            "resume": ResumeFrom(saver.state),
        },
        run_dir=tmp_path / "run",
        max_epochs=3,
        seed=1,
    )
    client = MlflowClient(tracking_uri=mlflow_server)
    runs = {
        r.data.tags["epochal.run_id"]: r
        for r in client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    }
    earlier, later = runs[first.loop.run_id], runs[second.loop.run_id]
    assert earlier.data.tags["epochal.superseded_after"] == str(restored)
    assert later.data.tags["epochal.continues"] == earlier.info.run_id
    assert later.data.params == earlier.data.params
    got = history(client, later.info.run_id, "train.loss")
    assert [s for s, _ in got] == sorted({s for s, _ in got}), "no duplicated step"
    assert got == expected(first.log, "train.loss", upto=restored) + expected(
        second.log, "train.loss", after=restored
    )


def test_tracker_down_warns_once_training_goes_on_and_the_sqlite_log_is_whole(
    tmp_path: Path, down_uri: str
) -> None:
    """With MLflow's HTTP defaults in the environment (7 retries, 120 s): the plugin's own apply."""
    down = down_uri
    plugin = MLflow(down, retry_seconds=0.2, close_timeout=1)
    with pytest.warns(RuntimeWarning) as caught:
        result = run_loop(
            {
                "train": TrainRecords(),
                "mlflow": plugin,
                "sqlite_log": SQLiteLog(path=str(tmp_path / "log.sqlite")),
            },
            run_dir=tmp_path / "run",
            max_epochs=3,
        )
    messages = [str(w.message) for w in caught if str(w.message).startswith("mlflow:")]
    assert len([m for m in messages if "cannot send" in m]) == 1, messages
    assert any(f"to the tracker at {down}" in m for m in messages)
    assert any("record(s) not sent" in m for m in messages), messages
    assert result.loop.epoch == 3 and result.log.status["status"] == "finished"
    with Reader(tmp_path / "log.sqlite") as reader:
        run = reader.get(result.loop.run_id)
        assert run is not None and run.status == "finished"
        assert len(list(reader.records(run.run_id, keys=["train.loss"]))) == len(
            result.log.history("train.loss")
        )


@pytest.mark.parametrize("uri", ["foo://bar", "not a uri"])
def test_a_tracking_uri_the_store_refuses_is_said_once_naming_the_option_and_not_retried(
    tmp_path: Path, uri: str
) -> None:
    # found by an outside-user pass: a bad scheme (or MLflow 3's refused file store) was handled
    # as an outage: retried, then the whole close_timeout waited, and no reason given
    plugin = MLflow(uri, retry_seconds=0.2, close_timeout=30)
    with pytest.warns(RuntimeWarning) as caught:
        result = run_loop({"train": TrainRecords(), "mlflow": plugin}, run_dir=tmp_path / "run", max_epochs=3)
    messages = [str(w.message) for w in caught if str(w.message).startswith("mlflow:")]
    assert len(messages) == 1, messages  # no "cannot send", no "did not take the last records"
    assert f"the MLflow tracking store {uri} refused this run ([plugins.mlflow] tracking_uri)" in messages[0]
    assert result.loop.epoch == 3 and result.log.status["status"] == "finished"
    assert plugin.finished is not None and plugin.finished.store_refused and plugin.finished.sent == 0


def test_records_past_the_bound_are_dropped_oldest_first(tmp_path: Path, down_uri: str) -> None:
    plugin = MLflow(down_uri, max_buffered=5, retry_seconds=0.2, close_timeout=0.5)
    with pytest.warns(
        RuntimeWarning, match="mlflow: 5 records are waiting for the tracker at .*dropping the oldest"
    ):
        run_loop({"train": TrainRecords(), "mlflow": plugin}, run_dir=tmp_path / "run", max_epochs=3)
    assert plugin.finished is not None and plugin.finished.dropped > 0


def test_a_metric_name_the_tracker_refuses_is_named_and_the_rest_is_sent(
    tmp_path: Path, mlflow_server: str
) -> None:
    experiment = f"e-{uuid.uuid4().hex[:8]}"

    class BadName:
        @hookimpl
        def after_batch(self, loop: Any) -> None:
            loop.log.current_row["bad?name!"] = 1.0

    with pytest.warns(
        RuntimeWarning, match=r"mlflow: the tracker at .* refused metric 'bad\?name!' at step 1"
    ):
        result = run_loop(
            {"train": TrainRecords(), "bad": BadName(), "mlflow": MLflow(mlflow_server, experiment)},
            run_dir=tmp_path / "run",
        )
    client = MlflowClient(tracking_uri=mlflow_server)
    run = only_run(client, experiment)
    assert "bad?name!" not in run.data.metrics
    assert history(client, run.info.run_id, "train.loss") == expected(result.log, "train.loss")


def test_an_unwritable_run_directory_warns_once_and_training_goes_on(tmp_path: Path) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    with pytest.warns(RuntimeWarning) as caught:
        result = run_loop(
            {
                "train": TrainRecords(),
                "mlflow": MLflow(),
                "sqlite_log": SQLiteLog(path=str(tmp_path / "log.sqlite")),
            },
            run_dir=blocked / "run",
        )
    messages = [str(w.message) for w in caught if str(w.message).startswith("mlflow:")]
    assert len(messages) == 1 and "cannot create the local MLflow store in" in messages[0], messages
    assert result.log.status["status"] == "finished"
    with Reader(tmp_path / "log.sqlite") as reader:
        assert reader.get(result.loop.run_id) is not None


@pytest.mark.parametrize(
    ("option", "value", "problem"),
    [
        ("flush_every", -1, "greater than or equal to 0"),
        ("max_buffered", 0, "greater than or equal to 1"),
        ("request_timeout", 0, "greater than 0"),
        ("retry_seconds", 0.0, "greater than 0"),
    ],
)
def test_options_are_checked(option: str, value: Any, problem: str) -> None:
    with pytest.raises(PluginError, match=rf"option '{option}' of plugin 'mlflow' must be {problem}"):
        load_plugins(order=["mlflow"], autoload=False, options={"mlflow": {option: value}})


def test_handing_records_over_only_at_epoch_ends_leaves_after_batch_idle() -> None:
    assert MLflow(flush_every=0).idle_hooks == {"after_batch"} and not MLflow().idle_hooks


class FailAt:
    """A model whose ``train_step`` raises *error* at batch *at* (counted from 1)."""

    def __init__(self, at: int, error: BaseException) -> None:
        from epochal.examples.tiny import TinyModel

        self.model, self.at, self.error, self.batches = TinyModel(), at, error, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)

    def train_step(self, batch: Any) -> Mapping[str, Any]:
        self.batches += 1
        if self.batches == self.at:
            raise self.error
        return self.model.train_step(batch)


def test_a_failed_run_ends_its_mlflow_run_failed_with_what_was_logged(
    tmp_path: Path, mlflow_server: str
) -> None:
    experiment = f"e-{uuid.uuid4().hex[:8]}"
    result = run_loop(
        {"train": TrainRecords(), "mlflow": MLflow(mlflow_server, experiment)},
        model=FailAt(7, RuntimeError("boom")),
        run_dir=tmp_path / "run",
        max_epochs=3,
        raises=False,
    )
    assert isinstance(result.error, RuntimeError)
    client = MlflowClient(tracking_uri=mlflow_server)
    run = only_run(client, experiment)
    assert run.info.status == "FAILED"
    assert history(client, run.info.run_id, "train.loss") == expected(result.log, "train.loss")
    assert len(history(client, run.info.run_id, "train.loss")) == 6


def test_ctrl_c_ends_the_mlflow_run_killed(tmp_path: Path, mlflow_server: str) -> None:
    experiment = f"e-{uuid.uuid4().hex[:8]}"
    model = FailAt(3, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        run_loop(
            {"train": TrainRecords(), "mlflow": MLflow(mlflow_server, experiment)},
            model=model,
            run_dir=tmp_path / "run",
            max_epochs=3,
        )
    client = MlflowClient(tracking_uri=mlflow_server)
    run = only_run(client, experiment)
    assert run.info.status == "KILLED"
    assert [s for s, _ in history(client, run.info.run_id, "train.loss")] == [1, 2]


class ManyRecords:
    """*keys* records per batch (``m.0`` … ``m.<keys-1>``), a value from the iteration and the key."""

    def __init__(self, keys: int) -> None:
        self.keys = [f"m.{j}" for j in range(keys)]

    @hookimpl
    def after_batch(self, loop: Any) -> None:
        row = loop.log.current_row
        for j, key in enumerate(self.keys):
            row[key] = loop.iteration + j / 100


def test_a_backlog_goes_out_in_parallel_calls_and_every_record_arrives(
    tmp_path: Path, mlflow_server: str
) -> None:
    """9,600 records handed over at once (flush only at the end): ten calls, four at a time."""
    experiment = f"e-{uuid.uuid4().hex[:8]}"
    plugin = MLflow(mlflow_server, experiment, flush_every=10_000)
    result = run_loop({"many": ManyRecords(12), "mlflow": plugin}, run_dir=tmp_path / "run", max_epochs=200)
    assert result.loop.iteration == 800
    client = MlflowClient(tracking_uri=mlflow_server)
    run = only_run(client, experiment)
    assert run.info.status == "FINISHED"
    for j in range(12):
        assert history(client, run.info.run_id, f"m.{j}") == [
            (i, pytest.approx(i + j / 100)) for i in range(1, 801)
        ], j
    numeric = sum(number(v) is not None for _, row in result.log.rows() for v in row.values())
    assert numeric > 9600  # and the epochs' records (valid.loss, epochs_done)
    assert plugin.finished is not None and plugin.finished.sent == numeric and plugin.finished.ended


def test_the_plugins_http_settings_hold_in_its_threads_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """MLflow reads its HTTP settings per request: the plugin's apply in its own threads; every
    other thread, the user's MLflow calls included, keeps the environment's."""
    import threading

    from epochal_mlflow.http import policy
    from mlflow.environment_variables import MLFLOW_HTTP_REQUEST_MAX_RETRIES, MLFLOW_HTTP_REQUEST_TIMEOUT

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "77")
    monkeypatch.delenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", raising=False)
    inside: dict[str, Any] = {}
    entered, release = threading.Event(), threading.Event()

    def plugin_thread() -> None:
        with policy(timeout=2.5):
            inside["during"] = (MLFLOW_HTTP_REQUEST_MAX_RETRIES.get(), MLFLOW_HTTP_REQUEST_TIMEOUT.get())
            entered.set()
            release.wait(10)
        inside["after"] = (MLFLOW_HTTP_REQUEST_MAX_RETRIES.get(), MLFLOW_HTTP_REQUEST_TIMEOUT.get())

    thread = threading.Thread(target=plugin_thread)
    thread.start()
    assert entered.wait(10)
    outside = (MLFLOW_HTTP_REQUEST_MAX_RETRIES.get(), MLFLOW_HTTP_REQUEST_TIMEOUT.get())
    release.set()
    thread.join(10)
    assert inside["during"] == (0, 2.5)
    assert outside == (7, 77) == inside["after"]  # MLflow's default retries, the user's timeout
    assert "MLFLOW_HTTP_REQUEST_MAX_RETRIES" not in os.environ


class WaitForRun:
    """At the first batch, waits until the mlflow plugin's thread has created its MLflow run."""

    @hookimpl
    def after_batch(self, loop: Any) -> None:
        if loop.iteration == 1:
            tracker = loop.plugins["mlflow"].tracker
            while tracker.mlflow_run_id is None:
                time.sleep(0.01)


def test_records_left_at_the_deadline_are_counted_and_the_run_still_ends(
    tmp_path: Path, mlflow_server: str
) -> None:
    """close_timeout = 0: what is left is not sent, but the MLflow run is ended and tagged.

    4,800 records reach the thread at the epoch's end, just before the run ends: more than one
    round of calls (4 × 1,000), so some are left whatever the timing."""
    experiment = f"e-{uuid.uuid4().hex[:8]}"
    plugin = MLflow(mlflow_server, experiment, flush_every=10_000, close_timeout=0)
    with pytest.warns(RuntimeWarning) as caught:
        result = run_loop(
            {"wait": WaitForRun(), "many": ManyRecords(1200), "mlflow": plugin},
            run_dir=tmp_path / "run",
            max_epochs=1,
        )
    numeric = sum(number(v) is not None for _, row in result.log.rows() for v in row.values())
    assert plugin.finished is not None
    left = numeric - plugin.finished.sent
    assert left >= 800
    messages = [str(w.message) for w in caught if str(w.message).startswith("mlflow:")]
    assert len(messages) == 1, messages
    assert f"{left} record(s) not sent" in messages[0] and "ended as FINISHED" in messages[0]
    client = MlflowClient(tracking_uri=mlflow_server)
    run = only_run(client, experiment)
    assert run.info.status == "FINISHED"
    assert run.data.tags["epochal.records_not_sent"] == str(left)
