"""The ``monitor`` plugin, installed as a distribution, through real runs of the digits example."""

from __future__ import annotations

import copy
import itertools
import json
import math
import warnings
from pathlib import Path
from typing import Any

import pytest

from epochal import Loop, hookimpl, load_plugins
from epochal.examples.digits import make_data, make_model
from epochal.testing import EpochalCli, ResumeFrom, StubModel, digits_config

pytest_plugins = ["epochal.testing"]
pytestmark = pytest.mark.usefixtures("no_epochal_env")


class Recorder:
    """A test plugin that keeps every train batch's outputs and size, per epoch."""

    def __init__(self) -> None:
        self.epochs: list[list[tuple[dict[str, float], int]]] = [[]]

    @hookimpl
    def after_batch(self, batch: Any, outputs: Any) -> None:
        self.epochs[-1].append((dict(outputs), len(batch[0])))

    @hookimpl
    def after_epoch(self) -> None:
        self.epochs.append([])


def run(options: dict[str, Any] | None = None, extra: dict[str, object] | None = None, **loop: Any) -> Loop:
    """A digits run with the installed ``monitor`` (and *extra* test plugins after it)."""
    plugins = load_plugins(
        order=["monitor", *(extra or {})],
        autoload=False,
        options={"monitor": options or {}},
        extra=extra,
    )
    loop.setdefault("max_epochs", 2)
    result = Loop(make_model(), make_data(), plugins=plugins, seed=0, handle_signals=False, **loop)
    result.run()
    return result


def epoch_rows(loop: Loop) -> list[dict[str, Any]]:
    return [row for _, row in loop.log.rows() if "epochs_done" in row]


def train_records(loop: Loop) -> list[tuple[int, str, Any]]:
    return [(i, k, v) for i, row in loop.log.rows() for k, v in row.items() if k.startswith("train.")]


def test_the_installed_distribution_provides_monitor() -> None:
    from importlib.metadata import distribution

    dist = distribution("epochal-monitor")
    names = {ep.name: ep.value for ep in dist.entry_points if ep.group == "epochal.plugins"}
    assert names == {"monitor": "epochal_monitor.plugin:Monitor"}


def test_train_records_are_batch_size_weighted_means_of_the_epoch() -> None:
    recorder = Recorder()
    loop = run(extra={"recorder": recorder}, max_epochs=2)
    rows = epoch_rows(loop)
    assert len(rows) == 2
    for row, batches in zip(rows, recorder.epochs):
        for metric in ("loss", "accuracy"):
            total = sum(out[metric] * size for out, size in batches)
            count = sum(size for _, size in batches)
            assert row[f"train.{metric}"] == pytest.approx(total / count, rel=1e-12)
    assert len({len(b) for b in recorder.epochs[:2]}) == 1  # the last batch is smaller: weights matter
    assert recorder.epochs[0][-1][1] != recorder.epochs[0][0][1]


def test_per_metric_aggregation() -> None:
    recorder = Recorder()
    loop = run(
        {"aggregation": {"loss": "max", "accuracy": "last"}, "default_aggregation": "sum"},
        extra={"recorder": recorder},
        max_epochs=1,
    )
    (row,) = epoch_rows(loop)
    batches = recorder.epochs[0]
    assert row["train.loss"] == max(out["loss"] for out, _ in batches)
    assert row["train.accuracy"] == batches[-1][0]["accuracy"]
    loop = run({"aggregation": {"loss": "min", "accuracy": "sum"}}, max_epochs=1)
    (row,) = epoch_rows(loop)
    assert row["train.loss"] == min(out["loss"] for out, _ in batches)
    assert row["train.accuracy"] == pytest.approx(sum(out["accuracy"] for out, _ in batches))


def test_running_records_every_n_batches() -> None:
    recorder = Recorder()
    loop = run({"every_n_batches": 5}, extra={"recorder": recorder}, max_epochs=2)
    flat = [item for epoch in recorder.epochs for item in epoch]
    running = loop.log.history("train.loss.running")
    assert [i for i, _ in running] == list(range(5, len(flat) + 1, 5))
    previous = 0
    for iteration, value in running:
        window = flat[previous:iteration]
        expected = sum(o["loss"] * s for o, s in window) / sum(s for _, s in window)
        assert value == pytest.approx(expected, rel=1e-12)
        previous = iteration
    # the epoch records are still whole-epoch aggregates
    assert len(loop.log.history("train.loss")) == 2


def test_by_default_a_running_record_every_50_batches() -> None:
    recorder = Recorder()
    loop = run(extra={"recorder": recorder}, max_epochs=5)  # 5 x 23 batches: records at 50, 100
    flat = [item for epoch in recorder.epochs for item in epoch]
    assert len(flat) == 115
    for metric in ("loss", "accuracy"):
        running = loop.log.history(f"train.{metric}.running")
        assert [i for i, _ in running] == [50, 100]
        for iteration, value in running:  # the window since the previous record, across epochs
            window = flat[iteration - 50 : iteration]
            expected = sum(o[metric] * s for o, s in window) / sum(s for _, s in window)
            assert value == pytest.approx(expected, rel=1e-12)
    assert len(loop.log.history("train.loss")) == 5


def test_every_n_batches_0_writes_no_running_record() -> None:
    loop = run({"every_n_batches": 0}, max_epochs=5)
    assert not [key for _, row in loop.log.rows() for key in row if key.endswith(".running")]
    assert len(loop.log.history("train.loss")) == 5


def test_eval_schedule_options_set_the_loop() -> None:
    loop = run({"every_n_epochs": 2, "at_start": True}, max_epochs=4)
    assert loop.eval_every_n_epochs == 2 and loop.eval_at_start is True
    evaluated = [row.get("epochs_done", 0) for _, row in loop.log.rows() if "valid.loss" in row]
    assert evaluated == [0, 2, 4]
    default = run({}, max_epochs=2)
    assert [row.get("epochs_done") for _, row in default.log.rows() if "valid.loss" in row] == [1, 2]


class NanAfter:
    """Wraps the digits model: from batch *start* on, every *every*-th loss is NaN."""

    def __init__(self, start: int, every: int = 3) -> None:
        self.model = make_model()
        self.start, self.every, self.calls = start, every, 0

    def train_step(self, batch: Any) -> dict[str, float]:
        out = self.model.train_step(batch)
        self.calls += 1
        if self.calls >= self.start and (self.calls - self.start) % self.every == 0:
            out["loss"] = math.nan
        return out

    def eval_step(self, batch: Any) -> dict[str, float]:
        return self.model.eval_step(batch)

    def state_dict(self) -> dict[str, Any]:
        return self.model.state_dict()

    def load_state_dict(self, state: Any) -> None:
        self.model.load_state_dict(state)


def test_non_finite_values_are_recorded_and_reported_once() -> None:
    from epochal_monitor import NonFiniteMetricWarning

    plugins = load_plugins(order=["monitor"], autoload=False)
    loop = Loop(NanAfter(start=30), make_data(), plugins=plugins, max_epochs=3, handle_signals=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loop.run()
    reports = [w for w in caught if issubclass(w.category, NonFiniteMetricWarning)]
    assert len(reports) == 1
    message = str(reports[0].message)
    assert "train.loss" in message and "nan" in message
    assert "epoch 2" in message and "iteration 30" in message
    losses = [v for _, v in loop.log.history("train.loss")]
    assert not math.isnan(losses[0]) and math.isnan(losses[1]) and math.isnan(losses[2])
    assert all(math.isfinite(v) for _, v in loop.log.history("train.accuracy"))


@pytest.mark.parametrize("every", [7, None])  # None: the default, a record every 50 batches
def test_resume_mid_epoch_gives_bitwise_equal_records(every: int | None) -> None:
    options: dict[str, Any] = {"aggregation": {"accuracy": "max"}}
    if every is not None:
        options["every_n_batches"] = every
    full = run(options, max_epochs=3)
    # epoch 2, batch 10 of 23; in the middle of a window of 7 (29..35) and of the default's (1..50)
    stopped = run(options, max_epochs=3, max_iterations=33)
    assert stopped.batch_in_epoch == 10
    state = stopped.state_dict()
    state["plugins"] = json.loads(json.dumps(state["plugins"]))  # what a checkpoint stores
    assert state["plugins"]["monitor"]["state"]["epoch"]["loss"][2] == 10 * 64
    plugins = load_plugins(
        order=["monitor", "resume"],
        autoload=False,
        options={"monitor": options},
        extra={"resume": ResumeFrom(copy.deepcopy(state))},
    )
    resumed = Loop(make_model(), make_data(), plugins=plugins, max_epochs=3, handle_signals=False)
    resumed.run()
    assert resumed.resumed
    assert train_records(resumed) == train_records(full)
    assert len(train_records(full)) > 6
    running = [key for _, key, _ in train_records(resumed) if key.endswith(".running")]
    assert running and running == [key for _, key, _ in train_records(full) if key.endswith(".running")]
    assert state["plugins"]["monitor"]["state"]["window"]["loss"][2] > 0  # saved mid-window


def test_the_default_writes_running_records_through_the_cli(tmp_path: Path, epochal_cli: EpochalCli) -> None:
    config = digits_config(tmp_path / "run.toml", ["monitor", "sqlite_log"], max_epochs=5)
    shown = {}
    for name, extra in (("default", ()), ("off", ("--set", "plugins.monitor.every_n_batches=0"))):
        result = epochal_cli("run", str(config), *extra)
        assert result.returncode == 0, result.stderr
        result = epochal_cli("log", "show", "latest", "--config", str(config), "--json")
        assert result.returncode == 0, result.stderr
        shown[name] = json.loads(result.stdout)["rows"]
    running = [
        (row["iteration"], sorted(row["values"]))
        for row in shown["default"]
        if "train.loss.running" in row["values"]
    ]
    assert [iteration for iteration, _ in running] == [50, 100]  # 5 epochs of 23 batches
    assert all(keys == ["train.accuracy.running", "train.loss.running"] for _, keys in running)
    assert not [key for row in shown["off"] for key in row["values"] if key.endswith(".running")]
    assert [row["values"]["train.loss"] for row in shown["off"] if "train.loss" in row["values"]] == [
        row["values"]["train.loss"] for row in shown["default"] if "train.loss" in row["values"]
    ]  # the epoch records are the same


def test_non_finite_accumulators_survive_a_json_state() -> None:
    from epochal_monitor import Monitor

    monitor = Monitor(aggregation={"loss": "max"})
    monitor._epoch = {"loss": [3, math.inf, 4], "accuracy": [0, math.nan, 64]}
    state = json.loads(json.dumps(monitor.state_dict(), allow_nan=False))
    other = Monitor(aggregation={"loss": "max"})
    other.load_state_dict(state)
    assert other._epoch["loss"] == [3, math.inf, 4]
    assert math.isnan(other._epoch["accuracy"][1])


def test_cli_run_with_monitor(tmp_path: Path, epochal_cli: EpochalCli) -> None:
    config = digits_config(
        tmp_path / "run.toml", extra="\n[plugins.monitor]\nevery_n_epochs = 2\n", max_epochs=2
    )
    result = epochal_cli("run", str(config), "--plugins", "monitor")
    assert result.returncode == 0, result.stderr
    assert "finished after 2 epoch(s)" in result.stdout
    assert "valid: loss=" in result.stdout


@pytest.mark.parametrize(
    ("setting", "culprit"),
    [
        ('aggregation = {loss = "median"}', "aggregation"),
        ("every_n_batches = -1", "every_n_batches"),
        ('every_n_epochs = "2"', "every_n_epochs"),
        ('default_aggregation = "avg"', "default_aggregation"),
        ("evry_n_epochs = 2", "evry_n_epochs"),
    ],
)
def test_bad_options_exit_2_naming_the_option(
    tmp_path: Path, epochal_cli: EpochalCli, setting: str, culprit: str
) -> None:
    config = digits_config(tmp_path / "run.toml", extra=f"\n[plugins.monitor]\n{setting}\n")
    result = epochal_cli("run", str(config), "--plugins", "monitor")
    assert result.returncode == 2
    assert culprit in result.stderr and "monitor" in result.stderr
    assert "Traceback" not in result.stderr


def test_order_monitor_runs_before_early_stopping(epochal_cli: EpochalCli) -> None:
    result = epochal_cli("plugins", "--order", "--json")
    assert result.returncode == 0, result.stderr
    order = json.loads(result.stdout)["order"]
    after_epoch = order["after_epoch"]
    assert "monitor" in after_epoch
    for later in ("early_stopping", "checkpoint", "sqlite_log"):
        if later in after_epoch:
            assert after_epoch.index("monitor") < after_epoch.index(later)


@pytest.mark.parametrize("every", [0, 1, 2])
def test_a_metric_is_skipped_once_it_is_not_a_number(every: int) -> None:
    # every_n_batches 0, 1 and n > 1 take after_batch's inline paths; each must drop the metric
    import numpy as np

    outputs = [
        {"loss": 1.0, "note": 2.0},
        {"loss": 2.0, "note": "text"},  # not a number: note is no longer aggregated, from here on
        {"loss": np.float32(3.5), "note": 4.0},
    ]
    batches = [np.zeros((2, 1)), np.zeros((3, 1)), np.zeros((1, 1))]
    options = {"monitor": {"every_n_batches": every}}
    plugins = load_plugins(order=["monitor"], autoload=False, options=options)
    turns = itertools.cycle(outputs)  # one per batch, in turn
    model = StubModel(train=lambda batch: next(turns), evaluation={})
    loop = Loop(model, {"train": batches}, plugins=plugins, max_epochs=2, handle_signals=False)
    loop.run()
    losses, sizes = [1.0, 2.0, 3.5] * 2, [2, 3, 1] * 2
    windows = [range(end - every, end) for end in range(every, 7, every)] if every else []
    expected = [(w[-1] + 1, sum(losses[i] * sizes[i] for i in w) / sum(sizes[i] for i in w)) for w in windows]
    assert loop.log.history("train.loss.running") == expected
    # note: only the first batch's value, in the first window
    assert loop.log.history("train.note.running") == ([(every, 2.0)] if every else [])
    mean = (1.0 * 2 + 2.0 * 3 + 3.5) / 6
    assert loop.log.history("train.loss") == [(3, mean), (6, mean)]
    assert loop.log.history("train.note") == [(3, 2.0)]  # the epoch before it was skipped
