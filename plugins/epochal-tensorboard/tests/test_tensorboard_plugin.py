"""The tensorboard plugin in real loops; event files read back with tensorboard's own reader."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from epochal_tensorboard import TensorBoard
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from epochal import PluginError, hookimpl, load_plugins
from epochal.records import number
from epochal.testing import ResumeFrom, SaveAt, TrainRecords, run_loop, tiny_data


def read(log_dir: Path) -> EventAccumulator:
    """Every event file of *log_dir*, as TensorBoard loads them (purges included)."""
    accumulator = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "histograms": 0, "tensors": 0})
    accumulator.Reload()
    return accumulator


def scalars(accumulator: EventAccumulator, tag: str) -> list[tuple[int, float]]:
    return [(event.step, event.value) for event in accumulator.Scalars(tag)]


def test_every_numeric_record_is_a_scalar_with_its_iteration_as_step(tmp_path: Path) -> None:
    result = run_loop(
        {"train": TrainRecords(), "tensorboard": TensorBoard(flush_every=3)},
        run_dir=tmp_path / "run",
        max_epochs=3,
    )
    log = result.log
    events = read(tmp_path / "run" / "tensorboard")
    tags = set(events.Tags()["scalars"])
    keys = {key for _, row in log.rows() for key, value in row.items() if number(value) is not None}
    assert {"train.loss", "valid.loss"} <= keys
    assert tags == {key.replace(".", "/", 1) for key in keys}
    for key in keys:
        expected = [
            (i, pytest.approx(float(v), rel=1e-6)) for i, v in log.history(key) if number(v) is not None
        ]
        assert scalars(events, key.replace(".", "/", 1)) == expected, key


def test_the_monitors_default_running_records_are_per_step_scalars(tmp_path: Path) -> None:
    # monitor with its defaults: train.loss.running every 50 batches, at the step = the iteration
    result = run_loop(
        ["monitor", "tensorboard"], data=tiny_data(examples=8 * 40), run_dir=tmp_path / "run", max_epochs=3
    )
    events = read(tmp_path / "run" / "tensorboard")
    running = scalars(events, "train/loss.running")
    assert [step for step, _ in running] == [50, 100]  # 3 epochs of 40 batches
    assert running == [(i, pytest.approx(v, rel=1e-6)) for i, v in result.log.history("train.loss.running")]
    assert [step for step, _ in scalars(events, "train/loss")] == [40, 80, 120]  # the epoch means


class TimingRecords:
    """Writes a profiling record per epoch, as the timing plugin does."""

    @hookimpl
    def after_epoch(self, loop: Any) -> None:
        loop.log.current_row["timing.epoch"] = 0.25


@pytest.mark.parametrize("exclude", [None, []])
def test_profiling_records_are_left_out_unless_asked_for(tmp_path: Path, exclude: list[str] | None) -> None:
    options = {} if exclude is None else {"exclude": exclude}
    plugins = {"train": TrainRecords(), "timing": TimingRecords(), "tensorboard": TensorBoard(**options)}
    run_loop(plugins, run_dir=tmp_path / "run", max_epochs=2)
    tags = set(read(tmp_path / "run" / "tensorboard").Tags()["scalars"])
    assert "train/loss" in tags
    assert ("timing/epoch" in tags) == (exclude is not None)


def test_hparams_come_from_the_run_config(tmp_path: Path) -> None:
    from tensorboard.plugins.hparams import plugin_data_pb2

    loop_config = {"model": {"lr": 0.05, "factory": "x:y"}, "loop": {"max_epochs": 2}, "tags": ["a", "b"]}
    run_loop({"tensorboard": TensorBoard()}, run_dir=tmp_path / "run", config=loop_config)
    events = read(tmp_path / "run" / "tensorboard")
    content = events.PluginTagToContent("hparams")
    session = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"])
    hparams = session.session_start_info.hparams
    assert hparams["model.lr"].number_value == 0.05
    assert hparams["model.factory"].string_value == "x:y"
    assert hparams["loop.max_epochs"].number_value == 2
    assert hparams["tags"].string_value == "['a', 'b']"


def test_parameter_histograms_every_n_epochs(tmp_path: Path) -> None:
    result = run_loop({"tensorboard": TensorBoard(histogram_every=2)}, run_dir=tmp_path / "run", max_epochs=4)
    events = read(tmp_path / "run" / "tensorboard")
    names = sorted(result.loop.model.state_dict())
    assert sorted(events.Tags()["histograms"]) == [f"parameters/{n}" for n in names]
    per_epoch = result.loop.iteration // 4
    steps = [event.step for event in events.Histograms(f"parameters/{names[0]}")]
    assert steps == [2 * per_epoch, 4 * per_epoch]


def test_resumed_run_supersedes_the_steps_after_the_restored_state(tmp_path: Path) -> None:
    """Run A saves its state after epoch 1 and goes on to epoch 3; run B resumes from epoch 1."""
    saver = SaveAt(1)
    first = run_loop(
        {"train": TrainRecords(), "tensorboard": TensorBoard(), "saver": saver},
        run_dir=tmp_path / "run",
        max_epochs=3,
        seed=0,
    )
    assert saver.state is not None
    restored = saver.state["iteration"]
    # The resumed run goes a different way (another seed) so stale values would show.
    second = run_loop(
        {"train": TrainRecords(), "tensorboard": TensorBoard(), "resume": ResumeFrom(saver.state)},
        run_dir=tmp_path / "run",
        max_epochs=3,
        seed=1,
    )
    assert second.loop.resumed_from == first.loop.run_id
    assert len(list((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))) == 2
    events = read(tmp_path / "run" / "tensorboard")
    got = scalars(events, "train/loss")
    steps = [step for step, _ in got]
    assert steps == sorted(set(steps)), "no duplicated step"
    before = [(i, pytest.approx(v)) for i, v in first.log.history("train.loss") if i <= restored]
    after = [(i, pytest.approx(v)) for i, v in second.log.history("train.loss") if i > restored]
    assert after and got == before + after


def test_unwritable_directory_warns_and_training_goes_on(tmp_path: Path) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    with pytest.warns(RuntimeWarning, match=r"tensorboard: cannot write event files in .*file"):
        result = run_loop({"tensorboard": TensorBoard(dir=str(blocked / "tb"))}, run_dir=tmp_path / "run")
    assert result.log.status["status"] == "finished" and result.loop.epoch == 2


def test_a_failing_write_warns_once_and_training_goes_on(tmp_path: Path) -> None:
    plugin = TensorBoard()

    class Breaker:
        @hookimpl
        def after_epoch(self, loop: Any) -> None:
            if loop.epoch == 1 and plugin._writer is not None:

                def refuse(*args: Any, **kwargs: Any) -> None:
                    raise OSError("No space left on device")

                plugin._writer._get_file_writer().add_summary = refuse

    with pytest.warns(
        RuntimeWarning, match=r"tensorboard: cannot write record 'train.loss': No space"
    ) as caught:
        result = run_loop(
            {"train": TrainRecords(), "breaker": Breaker(), "tensorboard": plugin},
            run_dir=tmp_path / "run",
            max_epochs=3,
        )
    assert len([w for w in caught if "tensorboard:" in str(w.message)]) == 1
    assert result.loop.epoch == 3 and result.log.status["status"] == "finished"


@pytest.mark.parametrize("option", ["flush_every", "histogram_every"])
def test_options_are_checked(option: str) -> None:
    with pytest.raises(
        PluginError, match=rf"option '{option}' of plugin 'tensorboard' must be greater than or"
    ):
        load_plugins(order=["tensorboard"], autoload=False, options={"tensorboard": {option: -1}})


def test_writing_only_at_epoch_ends_leaves_after_batch_idle() -> None:
    assert TensorBoard(flush_every=0).idle_hooks == {"after_batch"} and not TensorBoard().idle_hooks


def test_histograms_of_a_torch_model_use_its_named_parameters(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")

    class TorchModel:
        def __init__(self) -> None:
            self.net = torch.nn.Linear(3, 2)

        def named_parameters(self) -> Any:
            return self.net.named_parameters()

        def train_step(self, batch: Any) -> Mapping[str, Any]:
            loss = self.net(torch.ones(1, 3)).sum()
            return {"loss": loss.detach()}  # a 0-d tensor: written as a scalar

        def eval_step(self, batch: Any) -> Mapping[str, Any]:
            return {}

        def state_dict(self) -> dict[str, Any]:
            return self.net.state_dict()

        def load_state_dict(self, state: Mapping[str, Any]) -> None:
            self.net.load_state_dict(state)

    model = TorchModel()
    run_loop(
        {"train": TrainRecords(), "tensorboard": TensorBoard(histogram_every=1)},
        model=model,
        data={"train": [[0]] * 3},
        run_dir=tmp_path / "run",
        max_epochs=1,
    )
    events = read(tmp_path / "run" / "tensorboard")
    assert sorted(events.Tags()["histograms"]) == ["parameters/bias", "parameters/weight"]
    (histogram,) = events.Histograms("parameters/weight")
    assert histogram.histogram_value.num == 6
    assert histogram.histogram_value.min == pytest.approx(float(model.net.weight.detach().min()))
    assert len(events.Scalars("train/loss")) == 3
