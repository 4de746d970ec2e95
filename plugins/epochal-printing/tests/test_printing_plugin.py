"""The printing plugin, installed as a distribution: lines per epoch and per N batches."""

from __future__ import annotations

from pathlib import Path

import pytest
from epochal_printing import Printing
from epochal_printing.plugin import format_metrics

from epochal.testing import EpochalCli, digits_config

pytest_plugins = ["epochal.testing"]


def test_on_by_default_without_a_terminal(epochal_cli: EpochalCli, tmp_path: Path) -> None:
    config = digits_config(tmp_path / "run.toml", ["monitor", "timing", "printing"], max_epochs=2)
    result = epochal_cli("run", str(config))
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stdout.splitlines() if line.startswith("epoch ")]
    assert len(lines) == 2
    assert lines[0].startswith("epoch 1/2 (iteration ")
    for line in lines:
        assert "train loss=" in line and "| valid loss=" in line and "accuracy=" in line
        assert "timing" not in line
    assert "training finished: max_epochs=2 reached" in result.stdout


def test_running_records_are_not_in_the_epoch_lines_unless_asked(
    epochal_cli: EpochalCli, tmp_path: Path
) -> None:
    # a running record every 23 batches: in the row of every epoch's last batch (23 per epoch)
    monitor = "\n[plugins.monitor]\nevery_n_batches = 23\n"
    lines = {}
    for exclude in ("", "\n[plugins.printing]\nexclude = []\n"):
        config = digits_config(
            tmp_path / "run.toml", ["monitor", "printing"], max_epochs=2, extra=monitor + exclude
        )
        result = epochal_cli("run", str(config))
        assert result.returncode == 0, result.stderr
        # an epoch's line, or its lines (one per stream) where it is wider than a job log's 120
        lines[exclude] = result.stdout.split("training finished")[0].split("epoch ")[1:]
    assert len(lines[""]) == 2 and all("train loss=" in line and "running" not in line for line in lines[""])
    assert len(lines[exclude]) == 2 and all("loss.running=" in line for line in lines[exclude])


def test_batches_and_triggers(epochal_run) -> None:  # type: ignore[no-untyped-def]
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        epochal_run({"printing": Printing(batches=2)}, max_epochs=2)
    text = out.getvalue()
    batch_lines = [line for line in text.splitlines() if " batch " in line]
    assert batch_lines and all("train loss=" in line for line in batch_lines)
    assert [line.split("(iteration ")[1].split(")")[0] for line in batch_lines] == ["2", "4", "6", "8"]
    assert sum(line.startswith("epoch ") and " batch " not in line for line in text.splitlines()) == 2


def test_off_on_a_terminal_unless_asked(epochal_run, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    import io

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    for tty, expected in ((False, ""), (True, "epoch 1")):
        out = Terminal()
        monkeypatch.setattr("sys.stdout", out)
        epochal_run({"printing": Printing(tty=tty)}, max_epochs=1)
        assert (expected in out.getvalue()) if expected else out.getvalue() == ""


def test_format_groups_by_stream() -> None:
    row = {"epochs_done": 3, "train.loss": 0.25, "valid.loss": 0.5, "valid.accuracy": 0.75, "lr": 0.1}
    assert format_metrics(row, 2) == "train loss=0.25 | valid loss=0.50 accuracy=0.75 | log lr=0.10"
    row["timing.epoch"] = 0.5
    assert (
        format_metrics(row, 2, exclude=["timing.*", "valid.acc*"])
        == "train loss=0.25 | valid loss=0.50 | log lr=0.10"
    )


def test_a_best_so_far_record_follows_the_value_it_is_the_best_of() -> None:
    row = {"valid.loss": 0.5, "valid.loss.best": 0.25, "train.loss": 0.25, "train.loss.best": 0.25}
    assert format_metrics(row, 2) == "train loss=0.25 (best) | valid loss=0.50 (best 0.25)"
    assert format_metrics({"valid.loss.best": 0.25}, 2) == "valid loss.best=0.25"  # no value to follow


def test_flags_are_not_metrics_and_the_order_is_fixed(epochal_cli: EpochalCli, tmp_path: Path) -> None:
    """Issue 29: ``loss.best_so_far=true`` read like a metric; the order followed the model's."""
    row = {"valid.accuracy": 0.75, "valid.loss": 0.5, "valid.loss.best_so_far": True, "train.loss": 0.25}
    assert format_metrics(row, 2) == "train loss=0.25 | valid loss=0.50 accuracy=0.75"
    extra = '[plugins.early_stopping]\nmonitor = "valid.loss"\n'
    config = digits_config(tmp_path / "run.toml", ["monitor", "early_stopping", "printing"], extra=extra)
    result = epochal_cli("run", str(config), env={"COLUMNS": "80"})
    assert result.returncode == 0, result.stderr
    # a path longer than the width (the run directory under pytest's tmp) is not cut
    assert all(len(line) <= 80 for line in result.stdout.splitlines() if "/" not in line), result.stdout
    epochs = result.stdout.split("epoch ")[1:3]  # too wide for 80 columns: a line per stream
    assert len(epochs) == 2
    for block in epochs:
        assert "best_so_far" not in block and "true" not in block, block
        valid = next(line for line in block.splitlines() if line.startswith("  valid "))
        assert valid.index("loss=") < valid.index("accuracy="), valid


def test_job_log_lines_fit_120_columns_with_the_progress_blocks_facts(
    epochal_cli: EpochalCli, tmp_path: Path
) -> None:
    """Issue 47: piped epoch lines of 150-190 characters, ``loss.best`` read as a metric of the
    stream, and ``lr`` in the piped line but never in the terminal's block."""
    extra = (
        '[plugins.early_stopping]\nmonitor = "valid.loss"\n'
        '[plugins.lr_scheduler]\nname = "StepLR"\nstep_size = 1\n'
        "[plugins.printing]\ndigits = 8\n[plugins.progress]\nforce = true\n"
    )
    plugins = ["monitor", "early_stopping", "lr_scheduler", "printing", "progress"]
    config = digits_config(tmp_path / "run.toml", plugins, extra=extra)
    result = epochal_cli("run", str(config), env={"COLUMNS": ""})  # a job: no terminal, no $COLUMNS
    assert result.returncode == 0, result.stderr
    assert all(len(line) <= 120 for line in result.stdout.splitlines()), result.stdout
    printed = result.stdout.split("epoch 2/2 (iteration 46):")[1].split("training finished")[0]
    assert "loss.best" not in printed
    assert "  valid loss=1." in printed and " (best) accuracy=" in printed, printed
    assert "  log lr=0.02000000" in printed, printed
    block = result.stderr.split("epoch 2/2 · ")[-1].split("epochal:")[0]  # progress's, forced
    assert "valid loss 1." in block and "(best) accuracy " in block and "log lr 0.02" in block, block
    assert "loss.best" not in block


@pytest.mark.parametrize(
    ("option", "value", "problem"),
    [
        ("batches", -1, "greater than or equal to 0"),
        ("stream", "file", "'stdout' or 'stderr'"),
        ("digits", 13, "less"),
    ],
)
def test_bad_options_are_refused(option: str, value: object, problem: str) -> None:
    from epochal import PluginError, load_plugins

    with pytest.raises(
        PluginError, match=rf"\[plugins.printing\]: option '{option}' of plugin 'printing' must be {problem}"
    ):
        load_plugins(order=["printing"], autoload=False, options={"printing": {option: value}})
