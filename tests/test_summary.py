"""``epochal.summary``: the closing summary's metric lines, best values, and the plugins' lines."""

from __future__ import annotations

from epochal import hookimpl
from epochal.examples.tiny import TinyModel, tiny_data
from epochal.summary import RunSummary, format_metrics, higher_is_better
from epochal.testing import run_loop


def test_the_direction_of_a_metric_follows_its_name():
    assert higher_is_better("valid.accuracy") and higher_is_better("valid.f1")
    assert not higher_is_better("valid.loss") and not higher_is_better("train.mae")


def test_format_metrics_gives_four_significant_digits_and_the_epoch():
    assert format_metrics({"loss": 0.123456, "acc": 0.5}, {"loss": 3}) == "loss=0.1235 (epoch 3), acc=0.5"


class Says:
    @hookimpl
    def run_summary(self, loop):
        return [f"said after {loop.epoch} epochs"]


def test_the_summary_has_the_run_line_the_last_and_best_metrics_and_the_plugins_lines():
    summary = RunSummary()
    result = run_loop(
        {"says": Says(), "epochal.summary": summary}, model=TinyModel(), data=tiny_data(), max_epochs=3
    )
    lines = summary.lines(result.loop, 1.5)
    assert (
        lines[0].startswith(f"epochal: run {result.loop.run_id}") and "finished after 3 epoch(s)" in lines[0]
    )
    assert any(line.startswith("epochal: last valid: loss=") for line in lines)
    best = next(line for line in lines if line.startswith("epochal: best valid:"))
    assert "(epoch " in best
    assert lines[-1] == "epochal: said after 3 epochs"


def test_a_resume_with_nothing_left_to_train_says_so(capsys):
    from epochal.testing import ResumeFrom

    first = run_loop({}, model=TinyModel(), data=tiny_data(), max_epochs=2)
    summary = RunSummary()
    plugins = {"resume": ResumeFrom(first.loop.state_dict()), "epochal.summary": summary}
    again = run_loop(plugins, model=TinyModel(), data=tiny_data(), max_epochs=2)
    err = " ".join(capsys.readouterr().err.split())  # wrapped at 120 characters (a job log)
    assert again.loop.iteration == first.loop.iteration  # nothing trained
    assert "epochal: nothing left to train: the state resumed is at max_epochs = 2 already (2 done)" in err
    assert "--set loop.max_epochs=N" in err
    run_loop(
        {"resume": ResumeFrom(first.loop.state_dict()), "epochal.summary": RunSummary()},
        model=TinyModel(),
        data=tiny_data(),
        max_epochs=3,
    )
    assert "nothing left" not in capsys.readouterr().err
