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
        lines[exclude] = [line for line in result.stdout.splitlines() if line.startswith("epoch ")]
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


def test_flags_are_not_metrics_and_the_order_is_fixed(epochal_cli: EpochalCli, tmp_path: Path) -> None:
    """Issue 29: ``loss.best_so_far=true`` read like a metric; the order followed the model's."""
    row = {"valid.accuracy": 0.75, "valid.loss": 0.5, "valid.loss.best_so_far": True, "train.loss": 0.25}
    assert format_metrics(row, 2) == "train loss=0.25 | valid loss=0.50 accuracy=0.75"
    extra = '[plugins.early_stopping]\nmonitor = "valid.loss"\n'
    config = digits_config(tmp_path / "run.toml", ["monitor", "early_stopping", "printing"], extra=extra)
    result = epochal_cli("run", str(config), env={"COLUMNS": "80"})
    assert result.returncode == 0, result.stderr
    assert all(len(line) <= 80 for line in result.stdout.splitlines()), result.stdout
    joined = result.stdout.replace("\n    ", " ")  # lines wrapped at 80 columns, one again
    lines = [line for line in joined.splitlines() if line.startswith("epoch ")]
    assert len(lines) == 2
    for line in lines:
        assert "best_so_far" not in line and "true" not in line, line
        assert "valid loss=" in line and line.index("valid loss=") < line.index(
            "accuracy=", line.index("| valid")
        )


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
