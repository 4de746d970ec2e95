"""The lr_scheduler plugin: schedules per epoch and per optimizer step, ReduceLROnPlateau,
nested and callable arguments, numpy models, exact resume (CLI), bad input."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from epochal_schedule import LRScheduler

from epochal import ConfigError, Loop, PluginError, load_plugins
from epochal.testing import StubModel, epochal_command
from epochal.torch import TorchModel

DIGITS = Path(__file__).resolve().parents[3] / "examples" / "digits.toml"


def halve(epoch: int) -> float:
    """A LambdaLR factor, named in TOML as "module:function"."""
    return 0.5**epoch


def batches(count: int = 4) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(0)
    return [(rng.standard_normal((8, 4)).astype(np.float32), rng.integers(0, 3, 8)) for _ in range(count)]


def torch_model(lr: float = 0.1, **options: Any) -> TorchModel:
    torch.manual_seed(0)
    module = torch.nn.Linear(4, 3)
    optimizer = torch.optim.SGD(module.parameters(), lr=lr)
    return TorchModel(module, optimizer, torch.nn.functional.cross_entropy, device="cpu", **options)


def lrs(loop: Loop, key: str = "lr") -> list[float]:
    return [value for _, value in loop.log.history(key)]


def run(scheduler: LRScheduler, model: Any = None, epochs: int = 4, **data: Any) -> Loop:
    loop = Loop(
        model or torch_model(),
        {"train": batches(), **data},
        plugins={"lr_scheduler": scheduler},
        max_epochs=epochs,
    )
    loop.run()
    return loop


def test_step_lr_per_epoch_logs_the_rate_each_epoch_used() -> None:
    loop = run(LRScheduler("StepLR", step_size=2, gamma=0.5))
    assert lrs(loop) == pytest.approx([0.1, 0.1, 0.05, 0.05])
    assert loop.model.optimizer.param_groups[0]["lr"] == pytest.approx(0.025)


def test_batch_interval_steps_once_per_optimizer_step() -> None:
    model = torch_model(accumulate_grad_batches=2)
    loop = run(LRScheduler("LinearLR", interval="batch", start_factor=0.5, total_iters=4), model, epochs=2)
    assert lrs(loop) == pytest.approx([0.05, 0.0625, 0.075, 0.0875])  # 8 batches, 4 optimizer steps
    assert model.optimizer_steps == 4


def test_reduce_on_plateau_watches_an_eval_metric() -> None:
    scheduler = LRScheduler("ReduceLROnPlateau", monitor="valid.loss", patience=0, factor=0.5, threshold=10.0)
    loop = run(scheduler, epochs=3, valid=batches(2))
    assert lrs(loop) == pytest.approx([0.1, 0.05, 0.025])  # "no improvement" every epoch


class ChosenValidLoss(StubModel):
    """A numpy model (an ``lr`` attribute) whose valid loss after epoch n is ``losses[n]``."""

    def __init__(self, losses: dict[int, float], batches_per_epoch: int = 4) -> None:
        super().__init__(evaluation=lambda batch: {"loss": self.losses[self.steps // self.per_epoch]})
        self.lr, self.losses, self.per_epoch, self.steps = 0.1, losses, batches_per_epoch, 0

    def train_step(self, batch: Any) -> dict[str, float]:
        self.steps += 1
        return {"loss": 1.0}


@pytest.mark.parametrize(
    ("losses", "rates", "final"),
    [
        # better at every evaluation: the rate never drops
        ({0: 2.30, 2: 0.26, 4: 0.16, 6: 0.15}, [0.1] * 6, 0.1),
        # worse at the evaluations after epochs 4 and 6: it drops there, and only there
        ({0: 2.30, 2: 0.26, 4: 0.30, 6: 0.35}, [0.1] * 4 + [0.01] * 2, 0.001),
    ],
)
def test_reduce_on_plateau_steps_only_in_epochs_with_an_evaluation(
    losses: dict[int, float], rates: list[float], final: float
) -> None:
    model = ChosenValidLoss(losses)
    scheduler = LRScheduler("ReduceLROnPlateau", monitor="valid.loss", patience=0, factor=0.1)
    loop = Loop(
        model, {"train": batches(), "valid": batches(2)}, plugins={"lr_scheduler": scheduler},
        max_epochs=6, eval_every_n_epochs=2, eval_at_start=True,
    )  # fmt: skip
    loop.run()
    assert [v for _, v in loop.log.history("valid.loss")] == list(losses.values())
    assert lrs(loop) == pytest.approx(rates)  # the rate each epoch trained with
    assert model.lr == pytest.approx(final)


def test_reduce_on_plateau_refuses_a_monitor_its_stream_does_not_log() -> None:
    model = ChosenValidLoss({2: 0.5, 4: 0.4})
    scheduler = LRScheduler("ReduceLROnPlateau", monitor="valid.los", patience=0)
    loop = Loop(
        model, {"train": batches(), "valid": batches(2)}, plugins={"lr_scheduler": scheduler},
        max_epochs=4, eval_every_n_epochs=2,
    )  # fmt: skip
    with pytest.raises(ConfigError, match=r"monitor 'valid.los' is not in the log at epoch 2 .*valid.loss"):
        loop.run()


def test_nested_schedulers_and_callables_from_toml_values() -> None:
    sequential = LRScheduler(
        "SequentialLR",
        schedulers=[
            {"name": "ConstantLR", "factor": 0.5, "total_iters": 2},
            {"name": "ExponentialLR", "gamma": 0.1},
        ],
        milestones=[2],
    )
    assert lrs(run(sequential)) == pytest.approx([0.05, 0.05, 0.1, 0.01])
    by_name = LRScheduler("LambdaLR", lr_lambda=f"{__name__}:halve")
    assert lrs(run(by_name, epochs=3)) == pytest.approx([0.1, 0.05, 0.025])


def test_several_parameter_groups_are_logged_each() -> None:
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 3))
    optimizer = torch.optim.SGD(
        [{"params": module[0].parameters()}, {"params": module[1].parameters(), "lr": 1.0}], lr=0.1
    )
    model = TorchModel(module, optimizer, torch.nn.functional.cross_entropy, device="cpu")
    loop = run(LRScheduler("ExponentialLR", gamma=0.5), model, epochs=2)
    assert lrs(loop) == pytest.approx([0.1, 0.05])
    assert lrs(loop, "lr.group1") == pytest.approx([1.0, 0.5])


class NumpyModel(StubModel):
    """A numpy model with an ``lr`` attribute; ``seen`` holds its value at every train step."""

    def __init__(self) -> None:
        super().__init__(evaluation={"loss": 1.0})
        self.lr = 0.2
        self.seen: list[float] = []

    def train_step(self, batch: Any) -> dict[str, float]:
        self.seen.append(self.lr)
        return {"loss": 1.0}


def test_a_numpy_model_with_an_lr_attribute_is_scheduled() -> None:
    model = NumpyModel()
    run(LRScheduler("StepLR", step_size=1, gamma=0.5), model, epochs=3)
    assert model.seen == pytest.approx([0.2] * 4 + [0.1] * 4 + [0.05] * 4)


def test_state_round_trips_and_a_resumed_schedule_continues(tmp_path: Path) -> None:
    pytest.importorskip("epochal_checkpoint")
    config = tmp_path / "run.toml"
    schedule = (
        '[plugins.lr_scheduler]\nname = "OneCycleLR"\ninterval = "batch"\nmax_lr = 0.5\ntotal_steps = 140\n'
    )
    config.write_text(
        DIGITS.read_text().replace("[plugins.early_stopping]", schedule + "\n[plugins.early_stopping]")
    )
    result = epochal_command(
        "check-resume", str(config), "--at", "40", "--set", "loop.max_epochs=2", "--disable", "progress",
        cwd=tmp_path, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "ok: interrupted after batch 40 of " in result.stdout
    assert "plugin states match" in result.stdout
    assert "lr_scheduler.step()` before `optimizer.step()" not in result.stderr
    listed = epochal_command("plugins", "--config", str(config), "--json", cwd=tmp_path)
    assert any(p["name"] == "lr_scheduler" and p["status"] == "loaded" for p in json.loads(listed.stdout))


def test_bad_options_name_the_table_and_key() -> None:
    with pytest.raises(PluginError, match=r"name = 'StepLRR' is not a scheduler .*did you mean 'StepLR'"):
        LRScheduler("StepLRR")
    with pytest.raises(
        PluginError, match=r"'stepsize' is not an argument of StepLR \(did you mean 'step_size'\?\)"
    ):
        LRScheduler("StepLR", stepsize=3)
    with pytest.raises(PluginError, match=r"\[plugins.lr_scheduler\] StepLR needs step_size"):
        LRScheduler("StepLR")
    # a value of the wrong type: refused when the plugin is made, not an epoch into the run
    with pytest.raises(PluginError, match=r"T_max = 'abc': CosineAnnealingLR takes int there"):
        LRScheduler("CosineAnnealingLR", T_max="abc")
    with pytest.raises(
        PluginError, match=r"anneal_strategy = 'cosine': OneCycleLR takes Literal\['cos', 'linear'\]"
    ):
        LRScheduler("OneCycleLR", max_lr=0.1, total_steps=10, anneal_strategy="cosine")
    LRScheduler("StepLR", step_size=2, gamma=1)  # an int where a float goes is one
    LRScheduler("OneCycleLR", max_lr=[0.1, 0.2], total_steps="auto")  # converted values are torch's
    options = {"name": "StepLR", "step_size": 1, "interval": "step"}
    with pytest.raises(
        PluginError, match=r"option 'interval' of plugin 'lr_scheduler' must be 'epoch' or 'batch'"
    ):
        load_plugins(order=["lr_scheduler"], autoload=False, options={"lr_scheduler": options})
    options = {"name": "StepLR", "step_size": 1, "frequency": 0}
    with pytest.raises(
        PluginError, match=r"'frequency' of plugin 'lr_scheduler' must be greater than or equal to 1"
    ):
        load_plugins(order=["lr_scheduler"], autoload=False, options={"lr_scheduler": options})
    no_rate = NumpyModel()
    no_rate.lr = "fast"  # type: ignore[assignment]
    with pytest.raises(PluginError, match="has no torch optimizer"):
        run(LRScheduler("StepLR", step_size=1), model=no_rate)


def test_it_loads_only_when_named() -> None:
    plugins = load_plugins(order=[], autoload=True)
    assert "lr_scheduler" not in plugins.plugins
    assert (
        "lr_scheduler"
        in load_plugins(order=[], options={"lr_scheduler": {"name": "StepLR", "step_size": 1}}).plugins
    )


def test_auto_length_is_the_runs_optimizer_steps_as_lightnings_estimate() -> None:
    """``total_steps = "auto"``: 3 epochs of 4 batches with accumulation 2 are 6 optimizer steps,
    so OneCycleLR ends exactly at its last step (one more step would be refused by torch)."""
    model = torch_model(accumulate_grad_batches=2)
    scheduler = LRScheduler("OneCycleLR", interval="batch", max_lr=0.5, total_steps="auto")
    loop = run(scheduler, model, epochs=3)
    assert loop.estimated_stepping_batches == 6 == model.optimizer_steps
    assert scheduler.scheduler.total_steps == 6
    assert lrs(loop)[0] == pytest.approx(0.5 / 25)  # OneCycleLR's start: max_lr / div_factor
    epochs = run(LRScheduler("CosineAnnealingLR", T_max="auto", frequency=2), epochs=4)
    assert epochs.plugins["lr_scheduler"].scheduler.T_max == 2  # 4 epochs, a step every 2nd


def test_auto_length_of_an_unbounded_run_is_one_line() -> None:
    loop = Loop(
        torch_model(),
        {"train": iter(batches())},  # no len(): the run's length is unknown
        plugins={"lr_scheduler": LRScheduler("OneCycleLR", interval="batch", max_lr=0.5, total_steps="auto")},
        max_epochs=2,
    )
    assert loop.estimated_stepping_batches == float("inf")
    with pytest.raises(ConfigError, match=r"total_steps = 'auto' needs a run of known length: set \[loop\]"):
        loop.run()


def test_a_resume_at_an_epochs_last_batch_does_not_warn_of_a_step_before_the_optimizers(
    tmp_path: Path,
) -> None:
    # found by an outside-user pass: a run stopped on an epoch's last batch saved a scheduler
    # that had not stepped yet; the resumed process stepped it first, and torch warned
    pytest.importorskip("epochal_checkpoint")
    example = Path(__file__).resolve().parents[3] / "examples" / "digits_torch.toml"
    config = tmp_path / "run.toml"
    config.write_text(example.read_text())
    result = epochal_command(
        "check-resume", str(config), "--at", "6", "--set", "loop.max_epochs=2",
        "--set", "data.batch_size=256", "--set", "model.channels=4", "--disable", "progress",
        cwd=tmp_path, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "ok: interrupted after batch 6 of " in result.stdout  # 6 batches an epoch: its last one
    assert "before `optimizer.step()`" not in result.stderr


def test_a_resume_that_changes_an_auto_length_under_way_is_one_error_naming_both_lengths() -> None:
    # found by an outside-user pass: a resume with another run length kept the saved
    # total_steps and OneCycleLR failed one step past it, a raw traceback
    import copy

    def scheduler() -> LRScheduler:
        return LRScheduler("OneCycleLR", interval="batch", max_lr=0.5, total_steps="auto")

    first = Loop(torch_model(), {"train": batches()}, plugins={"lr_scheduler": scheduler()}, max_epochs=4)
    first.run()
    state = copy.deepcopy(first.state_dict())
    halfway = Loop(torch_model(), {"train": batches()}, plugins={"lr_scheduler": scheduler()}, max_epochs=2)
    halfway.run()
    under_way = copy.deepcopy(halfway.state_dict())
    halfway.plugins["lr_scheduler"].scheduler.last_epoch = 3  # as if stopped early, 3 of 8 done
    under_way["plugins"]["lr_scheduler"]["state"] = halfway.plugins["lr_scheduler"].state_dict()
    same = Loop(torch_model(), {"train": batches()}, plugins={"lr_scheduler": scheduler()}, max_epochs=4)
    same.load_state_dict(state)
    same.run()  # the same length: fine (nothing left to train)
    longer = Loop(torch_model(), {"train": batches()}, plugins={"lr_scheduler": scheduler()}, max_epochs=4)
    longer.load_state_dict(under_way)
    with pytest.raises(
        ConfigError,
        match=r"total_steps = 'auto' makes this run's schedule 16 steps long, and the schedule saved "
        r"is 8 steps long, 3 of them done",
    ):
        longer.run()


def test_a_resume_after_an_auto_schedule_ended_starts_it_again_over_the_added_steps() -> None:
    # found by an outside-user pass: the summary's command to train on (max_epochs raised,
    # --resume) failed at once, as the length of the finished 'auto' schedule changed
    import copy

    def scheduler() -> LRScheduler:
        return LRScheduler("OneCycleLR", interval="batch", max_lr=0.5, total_steps="auto")

    first = run(scheduler(), epochs=2)  # 8 optimizer steps: the whole cycle
    state = copy.deepcopy(first.state_dict())
    longer = Loop(torch_model(), {"train": batches()}, plugins={"lr_scheduler": scheduler()}, max_epochs=5)
    longer.load_state_dict(state)
    longer.run()  # 12 steps more: a second cycle over them, not a step past the first's end
    rates = lrs(longer)
    assert len(rates) == 20 and rates[:8] == pytest.approx(lrs(first))
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    cycle = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.5, total_steps=12)
    fresh = []
    for _ in range(12):
        fresh.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        cycle.step()
    assert rates[8:] == pytest.approx(fresh)
    assert longer.plugins["lr_scheduler"].scheduler.total_steps == 12


@pytest.mark.slow
def test_the_summarys_command_to_train_on_an_auto_schedule_works(tmp_path: Path) -> None:
    """The run's summary prints a command that resumes and trains on (max_epochs raised): with
    ``T_max = "auto"`` it runs, the schedule starting again over the epochs it adds."""
    import shlex

    pytest.importorskip("epochal_checkpoint")
    config = tmp_path / "run.toml"
    schedule = '[plugins.lr_scheduler]\nname = "CosineAnnealingLR"\n'
    text = DIGITS.read_text().replace("[plugins.early_stopping]", schedule + "\n[plugins.early_stopping]")
    # stepped before the checkpoint of each epoch is saved
    ordered = '"early_stopping", "lr_scheduler", "checkpoint"'
    config.write_text(text.replace('"early_stopping", "checkpoint"', ordered))
    options = ("--disable", "progress", "--set", "plugins.lr_scheduler.T_max=auto")
    first = epochal_command("run", str(config), "--set", "loop.max_epochs=2", *options, cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    summary = first.stdout.replace(" \\\n    ", " ")  # a command wrapped at $COLUMNS, as pasted
    resume = next(line for line in summary.splitlines() if line.startswith("epochal: resume: "))
    command = shlex.split(resume.removeprefix("epochal: resume: "))
    assert command[:2] == ["epochal", "run"] and command[-1] == "--resume"
    assert "loop.max_epochs=20" not in command  # the file's own 20 epochs: the --set is dropped
    second = epochal_command(*command[1:], cwd=tmp_path, timeout=600)
    assert second.returncode == 0, second.stderr
    assert "T_max = 'auto' = 2) had ended; it starts again" in second.stderr
    assert "over the 18 epochs this run adds" in second.stderr
    # the rate each epoch trained with: 0.2 at the first epoch of each schedule (the example's lr)
    shown = [line for line in second.stdout.splitlines() if line.startswith("epoch ")]
    assert shown[0].startswith("epoch 3/20") and shown[0].endswith("lr=0.2000"), shown[0]
