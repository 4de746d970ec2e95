"""The tracking server goes away mid-run: stopped and started again, or stopped for good.

A real ``mlflow server`` of the module's own (``restartable_server``), stopped during training
and started again on the same port and backend store. With MLflow's HTTP defaults (7 retries
with backoff, 120 s timeout) a request to a stopped server takes minutes, so before the plugin
had its own settings the run gave up with most points missing and left the MLflow run RUNNING.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from epochal_mlflow import MLflow
from epochal_sqlite import Reader
from mlflow import MlflowClient

from epochal import hookimpl
from epochal.records import number
from epochal.testing import epochal_command, run_loop

pytestmark = pytest.mark.slow

Server = Any  # conftest.Server: the fixture's object (a conftest is not imported by tests)


class TrainLoss:
    @hookimpl
    def after_batch(self, loop: Any, outputs: Any) -> None:
        loop.log.current_row["train.loss"] = outputs["loss"]


class Outage:
    """Stops the server after batch *stop_at*; after batch *start_at*, once *down_seen* says the
    plugin noticed, starts it again (same port, same store) and waits until it answers."""

    def __init__(self, server: Server, stop_at: int, start_at: int, down_seen: Callable[[], bool]) -> None:
        self.server, self.stop_at, self.start_at, self.down_seen = server, stop_at, start_at, down_seen

    @hookimpl
    def after_batch(self, loop: Any) -> None:
        if loop.iteration == self.stop_at:
            self.server.stop()
        elif loop.iteration == self.start_at:
            deadline = time.monotonic() + 30
            while not self.down_seen() and time.monotonic() < deadline:
                time.sleep(0.1)
            self.server.start()


def test_a_server_back_after_an_outage_gets_every_point_one_warning_and_a_finished_run(
    tmp_path: Path, restartable_server: Server
) -> None:
    server = restartable_server
    if not server.running:
        server.start()
    experiment = f"outage-{uuid.uuid4().hex[:8]}"
    plugin = MLflow(server.uri, experiment, flush_every=2, retry_seconds=0.5, close_timeout=60)
    with pytest.warns(RuntimeWarning) as caught:

        def down_seen() -> bool:
            return any("cannot send" in str(w.message) for w in caught)

        result = run_loop(
            {"loss": TrainLoss(), "outage": Outage(server, 10, 20, down_seen), "mlflow": plugin},
            run_dir=tmp_path / "run",
            max_epochs=12,  # 4 batches an epoch: 48 points
        )
    messages = [str(w.message) for w in caught if str(w.message).startswith("mlflow:")]
    assert len(messages) == 1, messages
    assert f"to the tracker at {server.uri}" in messages[0] and "sent again every 0.5 s" in messages[0]
    client = MlflowClient(tracking_uri=server.uri)
    (run,) = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    assert run.info.status == "FINISHED"
    points = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "train.loss"))
    assert points == [(i, pytest.approx(float(v))) for i, v in result.log.history("train.loss")]
    assert [s for s, _ in points] == list(range(1, 49))
    assert plugin.finished is not None and plugin.finished.ended and plugin.finished.dropped == 0


OUTAGE_PLUGIN = '''
"""Stops the tracking server (its process group) after batch `at`, for good: once the mlflow
plugin has sent something (its MLflow run exists)."""
import os
import signal
import time

from epochal import hookimpl
from epochal_mlflow.testing import wait_until_closed


class Outage:
    def __init__(self, pgid: int, port: int, at: int) -> None:
        self.pgid, self.port, self.at = pgid, port, at

    @hookimpl
    def after_batch(self, loop):
        if loop.iteration != self.at:
            return
        tracker = loop.plugins["mlflow"].tracker
        deadline = time.monotonic() + 120
        while tracker.sent == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        os.killpg(self.pgid, signal.SIGKILL)
        wait_until_closed(self.port)
'''


def test_a_server_gone_for_good_ends_the_run_in_bounded_time_with_the_rest_intact(
    tmp_path: Path, restartable_server: Server
) -> None:
    server = restartable_server
    if not server.running:
        server.start()
    assert server.process is not None
    (tmp_path / "outage.py").write_text(OUTAGE_PLUGIN, encoding="utf-8")
    config = tmp_path / "run.toml"
    config.write_text(
        f"""[loop]
max_epochs = 12
seed = 0
run_dir = "run"

[model]
factory = "epochal.examples.tiny:TinyModel"

[data]
factory = "epochal.examples.tiny:tiny_data"

[plugins]
order = ["monitor", "checkpoint", "sqlite_log", "outage", "mlflow"]
autoload = false

[plugins.outage]
factory = "outage:Outage"
pgid = {server.process.pid}
port = {server.port}
at = 10

[plugins.mlflow]
tracking_uri = "{server.uri}"
experiment = "gone-{uuid.uuid4().hex[:8]}"
flush_every = 2
retry_seconds = 0.5
close_timeout = 3
""",
        encoding="utf-8",
    )
    started = time.monotonic()
    done = epochal_command("run", str(config), cwd=tmp_path, env={"EPOCHAL_DISABLE_PLUGIN_AUTOLOAD": "1"})
    took = time.monotonic() - started
    server.stop()  # reaps what the run killed
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    outage = [line for line in lines if "mlflow: cannot send" in line]
    last = [line for line in lines if "record(s) not sent" in line]
    assert len(outage) == 1 and f"to the tracker at {server.uri}" in outage[0], lines
    assert len(last) == 1 and "could not be ended and shows RUNNING" in last[0], lines
    assert len(lines) == 2, lines  # nothing else: no traceback, no retry messages of MLflow's
    # A bound, not a speed claim: MLflow's own retries (7, with backoff) alone take minutes.
    assert took < 120, took
    # The rest of the run: every point in the SQLite log, the run finished, its checkpoints.
    run_id = done.stdout.split()[2]
    with Reader(tmp_path / "epochal.sqlite") as reader:
        run = reader.get(run_id)
        assert run is not None and run.status == "finished"
        losses = [v for _, _, v in reader.records(run.run_id, keys=["train.loss"]) if number(v) is not None]
        assert len(losses) == 12  # monitor's train mean of every epoch
        assert (run.epochs_done, run.iterations_done) == (12, 48)
    assert (tmp_path / "run" / "version_0" / "checkpoints" / "latest").exists()
