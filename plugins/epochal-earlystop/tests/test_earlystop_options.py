"""``early_stopping`` on values chosen by the test: the best_so_far record as a trigger, and the
peers' options (Keras' ``mode = "auto"`` and ``baseline``, Lightning's ``stopping_threshold`` and
``divergence_threshold``, torch's ``threshold_mode``, Ignite's ``cumulative_delta``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from epochal import Loop, load_plugins
from epochal.examples.tiny import tiny_data
from epochal.testing import EpochalCli, digits_config

pytest_plugins = ["epochal.testing"]
pytestmark = pytest.mark.usefixtures("no_epochal_env")


class ChosenValues:
    """A model whose valid ``metric`` after epoch n is ``values[n - 1]`` (2 train batches an epoch)."""

    def __init__(self, values: list[float], metric: str = "loss") -> None:
        self.values, self.metric, self.steps = values, metric, 0

    def train_step(self, batch: Any) -> dict[str, float]:
        self.steps += 1
        return {"loss": 1.0}

    def eval_step(self, batch: Any) -> dict[str, float]:
        return {self.metric: self.values[self.steps // 2 - 1]}

    def state_dict(self) -> dict[str, Any]:
        return {"steps": np.array(self.steps)}

    def load_state_dict(self, state: Any) -> None:
        self.steps = int(state["steps"])


def run(values: list[float], metric: str = "loss", **options: Any) -> Loop:
    """Run early_stopping with *options* on *values* (one per epoch, as many epochs at most)."""
    plugins = load_plugins(order=["early_stopping"], autoload=False, options={"early_stopping": options})
    loop = Loop(
        ChosenValues(values, metric), tiny_data(examples=16), plugins=plugins,
        max_epochs=len(values), handle_signals=False,
    )  # fmt: skip
    loop.run()
    assert [v for _, v in loop.log.history(f"valid.{metric}")] == values[: loop.epoch]
    return loop


def flagged(loop: Loop, record: str = "valid.loss.best_so_far") -> list[int]:
    return [row["epochs_done"] for _, row in loop.log.rows() if row.get(record)]


def test_best_so_far_gates_a_checkpoint_in_the_epochs_with_a_new_best_only(tmp_path: Path) -> None:
    from epochal_checkpoint import list_checkpoints

    losses = [8.0, 7.0, 6.0, 3.0, 4.0, 5.0]
    options = {
        "early_stopping": {"patience": 10},
        "checkpoint": {
            "when": "valid.loss.best_so_far",
            "save_at_end": False,
            "keep_last": None,
            "dir": str(tmp_path / "checkpoints"),
        },
    }
    plugins = load_plugins(order=["early_stopping", "checkpoint"], autoload=False, options=options)
    loop = Loop(
        ChosenValues(losses), tiny_data(examples=16), plugins=plugins, max_epochs=6, handle_signals=False
    )
    loop.run()
    assert [v for _, v in loop.log.history("valid.loss")] == losses
    saved = [info.manifest["epoch"] for info in list_checkpoints(tmp_path / "checkpoints")[0]]
    assert saved == [1, 2, 3, 4]


# -- mode = "auto" (Keras) ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("monitor", "direction"),
    [
        ("valid.loss", "min"),
        ("train.loss", "min"),
        ("valid.nll_loss", "min"),
        ("valid.error_rate", "min"),
        ("test.mse", "min"),
        ("valid.accuracy", "max"),
        ("valid.top5_acc", "max"),
        ("valid.f1", "max"),
        ("valid.auc", "max"),
        ("valid.macro_precision", "max"),
        ("valid.score", None),  # says nothing
        ("valid.accuracy_loss", None),  # says both
    ],
)
def test_auto_mode_reads_the_direction_from_the_name(monitor: str, direction: str | None) -> None:
    from epochal_earlystop import EarlyStopping
    from epochal_earlystop.early_stopping import direction_of

    assert direction_of(monitor) == direction
    if direction is not None:
        assert EarlyStopping(monitor=monitor, mode="auto").mode == direction


def test_auto_mode_on_accuracy_stops_when_it_no_longer_increases() -> None:
    loop = run([0.5, 0.6, 0.7, 0.65], metric="accuracy", monitor="valid.accuracy", mode="auto", patience=0)
    assert loop.epoch == 4
    assert loop.log.status["finish_reason"].startswith("early_stopping: valid.accuracy did not increase")
    assert flagged(loop, "valid.accuracy.best_so_far") == [1, 2, 3]


# -- baseline (Keras) -----------------------------------------------------------------------------


def test_baseline_stops_a_run_that_improves_but_never_beats_it() -> None:
    loop = run([8.0, 7.0, 6.0, 5.5, 3.0, 2.0], baseline=5.0, patience=2)
    assert loop.epoch == 2  # two checks improved on the best, none on the baseline
    assert loop.log.status["finish_reason"] == (
        "early_stopping: valid.loss did not decrease below the baseline 5 for 2 check(s) "
        "(patience=2); best 7 after epoch 2"
    )
    assert flagged(loop) == [1, 2]  # new bests all the same


def test_beating_the_baseline_restarts_the_patience() -> None:
    loop = run([8.0, 4.5, 4.0, 3.0, 2.0, 1.0], baseline=5.0, patience=2)
    assert loop.epoch == 6 and loop.log.status["finish_reason"] == "max_epochs=6 reached"


# -- stopping_threshold and divergence_threshold (Lightning) --------------------------------------


def test_stopping_threshold_stops_once_the_value_is_better() -> None:
    loop = run([5.0, 3.0, 0.6, 0.5, 0.2], stopping_threshold=0.6)
    assert loop.epoch == 4  # 0.6 itself is not better than 0.6
    assert (
        loop.log.status["finish_reason"]
        == "early_stopping: valid.loss = 0.5 < stopping_threshold 0.6 after epoch 4"
    )
    assert loop.log.last("valid.loss.best") == 0.5


def test_stopping_threshold_in_max_mode() -> None:
    loop = run(
        [0.5, 0.9, 0.97, 0.99],
        metric="accuracy",
        monitor="valid.accuracy",
        mode="max",
        stopping_threshold=0.95,
    )
    assert loop.epoch == 3
    assert "valid.accuracy = 0.97 > stopping_threshold 0.95" in loop.log.status["finish_reason"]


def test_divergence_threshold_stops_at_once_whatever_the_patience() -> None:
    loop = run([5.0, 3.0, 4.0, 12.0, 1.0], divergence_threshold=10.0, patience=5)
    assert loop.epoch == 4
    assert loop.log.status["finish_reason"] == (
        "early_stopping: valid.loss = 12.0 > divergence_threshold 10 after epoch 4 (diverged)"
    )
    assert loop.log.status["early_stopping"]["best"] == 3.0


# -- threshold_mode (torch) and cumulative_delta (Ignite) -----------------------------------------


@pytest.mark.parametrize(("threshold_mode", "epochs"), [("abs", 4), ("rel", 2)])
def test_relative_min_delta_is_a_fraction_of_the_best(threshold_mode: str, epochs: int) -> None:
    # 9.5 beats 10 by more than 0.1 but not by more than 10 % of it
    loop = run([10.0, 9.5, 9.3, 9.1], min_delta=0.1, threshold_mode=threshold_mode, patience=1)
    assert loop.epoch == epochs
    if threshold_mode == "rel":
        reason = "did not decrease by more than 0.1 (relative) for 1 check(s) (patience=1)"
        assert loop.log.status["finish_reason"].startswith(f"early_stopping: valid.loss {reason}")


def test_cumulative_delta_measures_min_delta_from_the_last_improvement() -> None:
    losses = [10.0, 9.4, 8.8, 8.2, 7.6, 7.0]
    cumulative = run(losses, min_delta=1.0, patience=2)  # the default, as Keras and Lightning
    assert cumulative.epoch == 6  # 8.8 and 7.6 are more than 1 below 10 and 8.8
    assert flagged(cumulative) == [1, 3, 5]
    stepwise = run(losses, min_delta=1.0, patience=2, cumulative_delta=False)  # Ignite's default
    assert stepwise.epoch == 3  # no step of 0.6 beats the previous value by more than 1
    assert flagged(stepwise) == [1, 2, 3]  # each is the new best all the same
    assert stepwise.log.status["early_stopping"]["best"] == 8.8


# -- contradictions and bad values: one line naming the option, before the first batch -------------


@pytest.mark.parametrize(
    ("setting", "culprit", "words"),
    [
        (
            'monitor = "valid.accuracy"\nmode = "min"\nstopping_threshold = 0.95',
            "stopping_threshold",
            "mode = 'max'",
        ),
        (
            'monitor = "valid.loss"\nmode = "max"\ndivergence_threshold = 5.0',
            "divergence_threshold",
            "mode = 'min'",
        ),
        (
            "stopping_threshold = 0.5\ndivergence_threshold = 0.3",
            "stopping_threshold",
            "divergence_threshold",
        ),
        ("baseline = 0.3\nstopping_threshold = 0.5", "stopping_threshold", "baseline"),
        ("baseline = 0.5\ndivergence_threshold = 0.3", "divergence_threshold", "baseline"),
        ('monitor = "valid.score"\nmode = "auto"', "mode", "set mode = 'min' or 'max'"),
        ('threshold_mode = "relative"', "threshold_mode", "'relative'"),
        ('baseline = "low"', "baseline", "low"),
    ],
)
def test_contradictory_options_are_one_clear_line(
    tmp_path: Path, epochal_cli: EpochalCli, setting: str, culprit: str, words: str
) -> None:
    config = digits_config(
        tmp_path / "run.toml", extra=f"\n[plugins.early_stopping]\n{setting}\n", max_epochs=2
    )
    result = epochal_cli("run", str(config), "--plugins", "early_stopping")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "early_stopping" in lines[0] and culprit in lines[0] and words in lines[0]
    assert "epoch 1" not in result.stdout  # nothing trained
