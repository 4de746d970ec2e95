"""epochal.testing: the pytest plugin plugin authors use, used here as they would."""

from __future__ import annotations

import pytest

from epochal import hookimpl

pytest_plugins = ["epochal.testing"]


class StopAtTwo:
    @hookimpl
    def after_batch(self, loop):
        if loop.iteration == 2:
            loop.request_stop("two is enough")


def test_records_every_hook_call_in_order(epochal_run):
    result = epochal_run({}, max_epochs=1, eval_at_start=True)
    assert result.hooks()[:2] == ["before_training", "before_evaluation"]
    assert result.hooks()[-1] == "after_training"
    assert result.count("after_batch") == 4  # 32 examples in batches of 8
    evaluations = result.calls_of("after_evaluation")
    assert [c.kwargs["stream"] for c in evaluations] == ["valid", "valid"]
    assert set(evaluations[0].kwargs["metrics"]) == {"loss"}
    assert [c.iteration for c in result.calls_of("after_batch")] == [1, 2, 3, 4]


def test_sees_what_a_plugin_did(epochal_run):
    result = epochal_run({"stop": StopAtTwo()}, max_epochs=3)
    assert result.count("after_batch") == 2
    assert result.log.status["finish_reason"] == "two is enough"
    assert result.count("after_epoch") == 0


def test_errors_can_be_captured(epochal_run):
    class Boom:
        @hookimpl
        def before_epoch(self):
            raise KeyError("x")

    result = epochal_run({"boom": Boom()}, raises=False)
    assert isinstance(result.error, KeyError)
    assert result.hooks()[-1] == "on_error"
    assert result.loop.error_plugin == "boom"


def test_cli_fixture_and_digits_config(epochal_cli, tmp_path, monkeypatch):
    from epochal.testing import digits_config

    config = digits_config(tmp_path / "run.toml", [], max_epochs=1)
    monkeypatch.setenv("EPOCHAL_PLUGINS", "does_not_exist")  # must not leak into the subprocess
    result = epochal_cli("run", str(config))
    assert result.returncode == 0, result.stderr
    assert "finished after 1 epoch(s)" in result.stdout
    assert "valid: loss=" in result.stdout
    leaked = epochal_cli("run", str(config), env={"EPOCHAL_PLUGINS": "does_not_exist"})
    assert leaked.returncode == 2 and "'does_not_exist'" in leaked.stderr


def test_stub_model_and_train_records(epochal_run):
    from epochal.testing import StubModel, TrainRecords

    model = StubModel(train=lambda batch: {"loss": float(batch)}, evaluation={"acc": 0.5})
    data = {"train": [1.0, 2.0, 3.0], "valid": [0.0]}
    result = epochal_run({"records": TrainRecords()}, model=model, data=data, max_epochs=1)
    assert result.log.history("train.loss") == [(1, 1.0), (2, 2.0), (3, 3.0)]
    assert result.calls_of("after_evaluation")[0].kwargs["metrics"] == {"acc": 0.5}
    assert model.state_dict() == {}
    assert StubModel().train_step(None) == {"loss": 0.0}


def test_save_at_keeps_the_state_of_its_epoch_for_resume_from(epochal_run):
    from epochal.testing import ResumeFrom, SaveAt

    save = SaveAt(epoch=1)
    first = epochal_run({"save": save}, max_epochs=2)
    assert save.state is not None and save.state["iteration"] == 4  # 4 batches an epoch
    assert first.loop.iteration == 8
    resumed = epochal_run({"resume": ResumeFrom(save.state)}, max_epochs=2)
    assert [c.iteration for c in resumed.calls_of("after_batch")] == [5, 6, 7, 8]


def test_counting_torch_ops_lists_the_operators_run_inside_its_block():
    torch = pytest.importorskip("torch")
    from epochal.testing import counting_torch_ops

    x = torch.ones(3)
    with counting_torch_ops() as ops:
        y = torch.stack([x, x]).sum(0) + 1
    after = x * 2  # outside the block: not counted
    assert [op.split(".")[0] for op in ops] == ["stack", "sum", "add"], ops
    assert y.tolist() == [3.0, 3.0, 3.0] and after.tolist() == [2.0, 2.0, 2.0] and len(ops) == 3
