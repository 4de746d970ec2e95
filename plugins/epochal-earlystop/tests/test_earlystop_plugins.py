"""``early_stopping`` and ``finish_after``, installed as a distribution, through real digits runs."""

from __future__ import annotations

import copy
import itertools
import json
import math
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from epochal import Loop, hookimpl, load_plugins
from epochal.examples.digits import make_data, make_model
from epochal.testing import EpochalCli, ResumeFrom, digits_config, unwrapped

pytest_plugins = ["epochal.testing"]
pytestmark = pytest.mark.usefixtures("no_epochal_env")


class StopAt:
    """A test plugin that requests a stop after *epoch* epochs (an interruption)."""

    def __init__(self, epoch: int) -> None:
        self.epoch = epoch

    @hookimpl
    def after_epoch(self, loop: Any) -> None:
        if loop.epoch >= self.epoch:
            loop.request_stop("test: stop")


def run(
    order: list[str],
    options: dict[str, Any] | None = None,
    extra: dict[str, object] | None = None,
    model: Any = None,
    **loop: Any,
) -> Loop:
    plugins = load_plugins(order=[*order, *(extra or {})], autoload=False, options=options or {}, extra=extra)
    loop.setdefault("max_epochs", 20)
    result = Loop(model or make_model(), make_data(), plugins=plugins, seed=0, handle_signals=False, **loop)
    result.run()
    return result


def test_the_installed_distribution_provides_both_plugins() -> None:
    from importlib.metadata import distribution

    dist = distribution("epochal-earlystop")
    names = {ep.name: ep.value for ep in dist.entry_points if ep.group == "epochal.plugins"}
    assert names == {
        "early_stopping": "epochal_earlystop.early_stopping:EarlyStopping",
        "finish_after": "epochal_earlystop.finish_after:FinishAfter",
    }


# -- early_stopping ---------------------------------------------------------------------------


def test_stops_after_patience_checks_without_improvement_and_tracks_the_best() -> None:
    loop = run(["early_stopping"], {"early_stopping": {"patience": 2, "min_delta": 0.05}})
    reason = loop.log.status["finish_reason"]
    assert reason.startswith("early_stopping: valid.loss did not decrease by more than 0.05 for 2 check(s)")
    losses = [v for _, v in loop.log.history("valid.loss")]
    best, best_epoch, wait = losses[0], 1, 0
    for epoch, value in enumerate(losses[1:], start=2):
        if value < best - 0.05:
            best, best_epoch, wait = value, epoch, 0
        else:
            wait += 1
    assert wait == 2 and loop.epoch == len(losses) < 20
    assert loop.log.last("valid.loss.best") == best
    flagged = [row["epochs_done"] for _, row in loop.log.rows() if row.get("valid.loss.best_so_far")]
    assert flagged[0] == 1 and flagged[-1] == best_epoch
    assert all(_ for _ in flagged)
    assert loop.log.status["early_stopping"]["best_epoch"] == best_epoch
    assert str(best_epoch) in reason


def test_mode_max_on_accuracy() -> None:
    loop = run(
        ["early_stopping"],
        {"early_stopping": {"monitor": "valid.accuracy", "mode": "max", "patience": 0}},
        max_epochs=30,
    )
    accuracies = [v for _, v in loop.log.history("valid.accuracy")]
    assert accuracies[-1] <= max(accuracies[:-1])
    assert all(b > a for a, b in itertools.pairwise(accuracies[:-1]))  # improved until the last
    assert "valid.accuracy did not increase" in loop.log.status["finish_reason"]


def test_monitors_monitor_train_records() -> None:
    loop = run(
        ["monitor", "early_stopping"],
        {"early_stopping": {"monitor": "train.loss", "patience": 0, "min_delta": 1.0}},
    )
    assert loop.epoch == 2
    assert loop.log.last("train.loss.best") == loop.log.history("train.loss")[0][1]


class NanModel:
    """The digits model whose evaluation loss is NaN from the second evaluation on."""

    def __init__(self) -> None:
        self.model, self.evals = make_model(), 0

    def train_step(self, batch: Any) -> dict[str, float]:
        return self.model.train_step(batch)

    def eval_step(self, batch: Any) -> dict[str, float]:
        out = self.model.eval_step(batch)
        if self.evals >= 6:  # 6 valid batches per evaluation
            out["loss"] = math.nan
        self.evals += 1
        return out

    def state_dict(self) -> dict[str, Any]:
        return self.model.state_dict()

    def load_state_dict(self, state: Any) -> None:
        self.model.load_state_dict(state)


def test_stop_on_nan() -> None:
    loop = run(["early_stopping"], model=NanModel())
    assert loop.epoch == 2
    assert loop.log.status["finish_reason"] == "early_stopping: valid.loss is nan after epoch 2 (stop_on_nan)"
    loop = run(
        ["early_stopping"], {"early_stopping": {"stop_on_nan": False, "patience": 3}}, model=NanModel()
    )
    assert loop.epoch == 4
    assert "did not decrease for 3 check(s)" in loop.log.status["finish_reason"]


def test_restore_best_loads_the_best_epochs_model() -> None:
    class Snapshots:
        def __init__(self) -> None:
            self.states: dict[int, Any] = {}

        @hookimpl
        def after_epoch(self, loop: Any) -> None:
            self.states[loop.epoch] = copy.deepcopy(loop.model.state_dict())

    snapshots = Snapshots()
    loop = run(
        ["early_stopping"],
        {"early_stopping": {"patience": 1, "min_delta": 0.02, "restore_best": True}},
        extra={"snapshots": snapshots},
    )
    best_epoch = loop.log.status["early_stopping"]["best_epoch"]
    assert best_epoch < loop.epoch
    assert loop.log.status["early_stopping"]["restored_epoch"] == best_epoch
    final = loop.model.state_dict()
    for key, value in snapshots.states[best_epoch].items():
        np.testing.assert_array_equal(final[key], value)
    assert not np.array_equal(final["W1"], snapshots.states[loop.epoch]["W1"])


def test_an_instance_used_again_starts_a_fresh_run_afresh() -> None:
    # Keras' test_state_reset_across_fit_calls: the second run keeps no best, patience or weights
    from epochal_earlystop import EarlyStopping

    es = EarlyStopping(patience=2, restore_best=True)
    first = Loop(make_model(), make_data(), plugins={"early_stopping": es}, max_epochs=8, seed=0)
    first.run()
    weights_of_first = {k: v.copy() for k, v in first.model.state_dict().items()}
    # a model that trains worse: every value of its run is above the first run's best
    second = Loop(make_model(lr=0.02), make_data(), plugins={"early_stopping": es}, max_epochs=4, seed=0)
    second.run()
    losses = [v for _, v in second.log.history("valid.loss")]
    assert min(losses) > first.log.status["early_stopping"]["best"]
    assert all(b < a for a, b in itertools.pairwise(losses))  # it improves at every check
    assert second.epoch == 4 and second.log.status["finish_reason"] == "max_epochs=4 reached"
    assert second.log.status["early_stopping"]["best"] == losses[-1]
    assert second.log.status["early_stopping"]["best_epoch"] == 4
    assert not np.array_equal(second.model.state_dict()["W1"], weights_of_first["W1"])
    flagged = [row["epochs_done"] for _, row in second.log.rows() if row.get("valid.loss.best_so_far")]
    assert flagged == [1, 2, 3, 4]


def test_a_missing_record_warns_once_after_the_first_evaluation() -> None:
    from epochal_earlystop import EarlyStoppingWarning

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loop = run(["early_stopping", "timing"], {"early_stopping": {"monitor": "valid.los"}}, max_epochs=3)
    reports = [str(w.message) for w in caught if issubclass(w.category, EarlyStoppingWarning)]
    assert len(reports) == 1
    assert "'valid.los' is not in the log after epoch 1" in reports[0]
    assert "did you mean 'valid.loss'?" in reports[0]
    assert "records written: valid." in reports[0] and "timing." not in reports[0]  # its stream's
    assert loop.epoch == 3


def test_missing_record_waits_for_the_first_evaluation() -> None:
    from epochal_earlystop import EarlyStoppingWarning

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run(
            ["early_stopping"],
            {"early_stopping": {"monitor": "valid.nope"}},
            max_epochs=3,
            eval_every_n_epochs=3,
        )
    reports = [str(w.message) for w in caught if issubclass(w.category, EarlyStoppingWarning)]
    assert len(reports) == 1 and "after epoch 3" in reports[0]


def test_state_across_resume_continues_patience_and_best() -> None:
    options = {"early_stopping": {"patience": 3, "min_delta": 0.03, "restore_best": True}}
    full = run(["early_stopping"], options)
    stop_epoch = full.epoch - 2  # stop while the patience counter is running
    first = run(["early_stopping"], options, extra={"stop": StopAt(stop_epoch)})
    state = first.state_dict()
    saved = state["plugins"]["early_stopping"]["state"]
    assert saved["wait"] >= 1 and saved["best_epoch"] == full.log.status["early_stopping"]["best_epoch"]
    assert set(saved["best_state"]) == {"W1", "b1", "W2", "b2"}
    plugins_json = {k: v for k, v in saved.items() if k != "best_state"}
    json.dumps(plugins_json, allow_nan=False)
    resumed = run(["early_stopping"], options, extra={"resume": ResumeFrom(state)})
    assert resumed.resumed
    assert resumed.epoch == full.epoch
    assert resumed.log.status["finish_reason"] == full.log.status["finish_reason"]
    np.testing.assert_array_equal(resumed.model.state_dict()["W1"], full.model.state_dict()["W1"])


def test_cli_stop_reason(tmp_path: Path, epochal_cli: EpochalCli) -> None:
    extra = "\n[plugins.early_stopping]\npatience = 1\nmin_delta = 0.05\n"
    config = digits_config(tmp_path / "run.toml", extra=extra, max_epochs=20)
    result = epochal_cli("run", str(config), "--plugins", "monitor,early_stopping")
    assert result.returncode == 0, result.stderr
    reason = "early_stopping: valid.loss did not decrease by more than 0.05 for 1 check(s)"
    assert reason in unwrapped(result.stdout)


@pytest.mark.parametrize(
    ("setting", "culprit"),
    [
        ('mode = "minimum"', "mode"),
        ("patience = -1", "patience"),
        ("patience = 1.5", "patience"),
        ("min_delta = -0.1", "min_delta"),
        ('monitor = ""', "monitor"),
        ("restore = true", "restore"),
    ],
)
def test_early_stopping_bad_options(
    tmp_path: Path, epochal_cli: EpochalCli, setting: str, culprit: str
) -> None:
    config = digits_config(
        tmp_path / "run.toml", extra=f"\n[plugins.early_stopping]\n{setting}\n", max_epochs=20
    )
    result = epochal_cli("run", str(config), "--plugins", "early_stopping")
    assert result.returncode == 2
    assert culprit in result.stderr and "early_stopping" in result.stderr
    assert "Traceback" not in result.stderr


def test_order_early_stopping_between_monitor_and_checkpoint(tmp_path: Path, epochal_cli: EpochalCli) -> None:
    # named by its table (it is not autoloaded), placed by its phase (decide) alone
    config = digits_config(tmp_path / "run.toml", extra="\n[plugins.early_stopping]\npatience = 1\n")
    config.write_text(config.read_text().replace("autoload = false", "autoload = true"))
    result = epochal_cli("plugins", "--order", "--json", "--config", str(config))
    assert result.returncode == 0, result.stderr
    after_epoch = json.loads(result.stdout)["order"]["after_epoch"]
    assert after_epoch.index("monitor") < after_epoch.index("early_stopping")
    if "checkpoint" in after_epoch:
        assert after_epoch.index("early_stopping") < after_epoch.index("checkpoint")
    # an order the user writes wins over phases (a phase only prefers a place)
    written = epochal_cli(
        "plugins", "--order", "--json", "--plugins", "early_stopping,monitor",
        env={"EPOCHAL_DISABLE_PLUGIN_AUTOLOAD": "1"},
    )  # fmt: skip
    assert written.returncode == 0, written.stderr
    assert json.loads(written.stdout)["order"]["after_epoch"] == ["early_stopping", "monitor"]


# -- finish_after -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "epochs", "iterations", "reason"),
    [
        ({"epochs": 2}, 2, 46, "finish_after: epochs=2 reached"),
        ({"batches": 30}, 1, 30, "finish_after: batches=30 reached"),
        ({"epochs": 3, "batches": 100}, 3, 69, "finish_after: epochs=3 reached"),
    ],
)
def test_finish_after_limits(options: dict[str, Any], epochs: int, iterations: int, reason: str) -> None:
    loop = run(["finish_after"], {"finish_after": options})
    assert (loop.epoch, loop.iteration) == (epochs, iterations)
    assert loop.log.status["finish_reason"] == reason


def test_finish_after_seconds_counts_across_resume() -> None:
    from epochal_earlystop import FinishAfter

    tiny = run([], extra={"finish_after": FinishAfter(seconds=1e-9)})
    assert tiny.iteration == 0
    assert tiny.log.status["finish_reason"].startswith("finish_after: seconds=1e-09 reached")

    loop = run([], extra={"finish_after": FinishAfter(batches=5, seconds=1e6)})
    assert loop.iteration == 5
    state = loop.state_dict()
    state["plugins"] = json.loads(json.dumps(state["plugins"], allow_nan=False))
    elapsed = state["plugins"]["finish_after"]["state"]["elapsed"]
    assert elapsed > 0
    # a resumed run continues the count: a limit already used up stops it at once
    used_up = FinishAfter(seconds=elapsed / 2)
    resumed = run([], extra={"finish_after": used_up, "resume": ResumeFrom(copy.deepcopy(state))})
    assert resumed.resumed and resumed.iteration == 5
    assert resumed.log.status["finish_reason"].startswith(f"finish_after: seconds={elapsed / 2:g} reached")
    longer = FinishAfter(batches=8, seconds=1e6)
    resumed = run([], extra={"finish_after": longer, "resume": ResumeFrom(state)})
    assert resumed.iteration == 8
    assert longer.elapsed > elapsed


def test_finish_after_epochs_already_reached_on_resume() -> None:
    first = run(["finish_after"], {"finish_after": {"epochs": 2}})
    resumed = run(
        ["finish_after"], {"finish_after": {"epochs": 2}}, extra={"resume": ResumeFrom(first.state_dict())}
    )
    assert resumed.epoch == 2 and resumed.iteration == first.iteration
    assert resumed.log.status["finish_reason"] == "finish_after: epochs=2 reached"


def test_finish_after_cli_reason(tmp_path: Path, epochal_cli: EpochalCli) -> None:
    config = digits_config(
        tmp_path / "run.toml", extra="\n[plugins.finish_after]\nbatches = 10\n", max_epochs=20
    )
    result = epochal_cli("run", str(config), "--plugins", "finish_after")
    assert result.returncode == 0, result.stderr
    assert "after 0 epoch(s), 10 batch(es): finish_after: batches=10 reached" in result.stdout


@pytest.mark.parametrize(
    ("setting", "culprit"),
    [
        ("", "set at least one of the options epochs, batches, seconds"),
        ("epochs = 0", "epochs"),
        ("batches = -3", "batches"),
        ("seconds = 0", "seconds"),
        ('seconds = "10"', "seconds"),
        ("minutes = 3", "minutes"),
    ],
)
def test_finish_after_bad_options(
    tmp_path: Path, epochal_cli: EpochalCli, setting: str, culprit: str
) -> None:
    config = digits_config(
        tmp_path / "run.toml", extra=f"\n[plugins.finish_after]\n{setting}\n", max_epochs=20
    )
    result = epochal_cli("run", str(config), "--plugins", "finish_after")
    assert result.returncode == 2
    assert culprit in result.stderr and "finish_after" in result.stderr
    assert "Traceback" not in result.stderr


def test_finish_after_without_limits_is_an_error_when_named_and_inert_when_autoloaded(
    tmp_path: Path, epochal_cli: EpochalCli
) -> None:
    config = digits_config(tmp_path / "run.toml", max_epochs=1)  # autoload = false
    named = epochal_cli("run", str(config), "--plugins", "finish_after")
    assert named.returncode == 2 and "[plugins.finish_after]" in named.stderr
    autoload = ("--set", "plugins.autoload=true")
    named_with_autoload = epochal_cli("run", str(config), "--plugins", "finish_after", *autoload)
    assert named_with_autoload.returncode == 2 and "set at least one of" in named_with_autoload.stderr
    autoloaded = epochal_cli(
        "run", str(config), "--plugins", "monitor", "--disable", "progress,timing", *autoload
    )
    assert "finish_after" not in autoloaded.stderr
    assert "finished after 1 epoch(s)" in autoloaded.stdout
