"""Evaluation inside an epoch (``[loop] eval_every_n_batches``), through the ``epochal`` CLI.

The runs train :mod:`epochal.examples.tiny` (40 examples in batches of 8: 5 batches an epoch)
and read their log back with ``epochal log show --json``.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from epochal.testing import epochal_command

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cli_log import rows

pytest.importorskip("epochal_checkpoint")
pytest.importorskip("epochal_sqlite")
pytest.importorskip("epochal_earlystop")

CONFIG = """\
[loop]
max_epochs = 2
seed = 0
run_dir = "runs/tiny"
{loop}
[model]
factory = "epochal.examples.tiny:TinyModel"

[data]
factory = "epochal.examples.tiny:tiny_data"
examples = 40
batch_size = 8

[plugins]
order = {order}
autoload = false
{plugins}
"""


def write(tmp: Path, loop: str = "", plugins: str = "", order: str = '["sqlite_log"]') -> Path:
    config = tmp / "run.toml"
    config.write_text(CONFIG.format(loop=loop, plugins=textwrap.dedent(plugins), order=order))
    return config


def epochal(tmp: Path, *arguments: str) -> subprocess.CompletedProcess[str]:
    return epochal_command(*arguments, cwd=tmp)


def evaluated(tmp: Path) -> list[int]:
    return [row["iteration"] for row in rows(tmp) if "valid.loss" in row]


@pytest.mark.parametrize("every", ["2", "0.4"])
def test_evaluates_after_every_n_batches_of_each_epoch(tmp_path, every):
    # 0.4 of an epoch of 5 batches is 2 batches (Lightning's int(batches * fraction))
    result = epochal(tmp_path, "run", str(write(tmp_path, f"eval_every_n_batches = {every}")))
    assert result.returncode == 0, result.stderr
    # batches 2 and 4 of each epoch; none at the epoch ends (5, 10), which are no such point
    assert evaluated(tmp_path) == [2, 4, 7, 9]


def test_the_epoch_schedule_chooses_the_epochs_evaluated_inside(tmp_path):
    config = write(tmp_path, "eval_every_n_batches = 5\neval_every_n_epochs = 2")
    result = epochal(tmp_path, "run", str(config), "--set", "loop.max_epochs=4")
    assert result.returncode == 0, result.stderr
    assert evaluated(tmp_path) == [10, 20]  # the last batch of epochs 2 and 4


def test_with_no_epoch_schedule_the_batches_are_counted_over_the_run_and_a_resume(tmp_path):
    # Lightning's val_check_interval=3 with check_val_every_n_epoch=None: batches 3, 6, 9, ...
    # of the run, across epoch ends, an interval longer than an epoch allowed
    config = write(
        tmp_path, "eval_every_n_batches = 3\neval_every_n_epochs = 0", order='["sqlite_log", "checkpoint"]'
    )
    result = epochal(tmp_path, "run", str(config))
    assert result.returncode == 0, result.stderr
    assert evaluated(tmp_path) == [3, 6, 9]  # 2 epochs of 5 batches; none at the epoch ends
    resumed = epochal(tmp_path, "run", str(config), "--set", "loop.max_epochs=4", "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert [i for i in evaluated(tmp_path) if i > 10] == [12, 15, 18]  # counted on from the run's start
    longer = write(tmp_path, "eval_every_n_batches = 7\neval_every_n_epochs = 0")
    assert epochal(tmp_path, "run", str(longer), "--set", "loop.max_epochs=3").returncode == 0
    assert evaluated(tmp_path) == [7, 14]


def test_checkpoints_and_early_stopping_see_the_in_epoch_rows(tmp_path):
    plugins = """
    [plugins.early_stopping]
    monitor = "valid.loss"
    patience = 50
    [plugins.checkpoint]
    every_n_batches = 1
    when = "valid.loss.best_so_far"
    keep_last = "none"
    save_at_end = false
    """
    order = '["early_stopping", "checkpoint", "sqlite_log"]'
    config = write(tmp_path, "eval_every_n_batches = 2", plugins, order)
    result = epochal(tmp_path, "run", str(config))
    assert result.returncode == 0, result.stderr
    best = [row["iteration"] for row in rows(tmp_path) if row.get("valid.loss.best_so_far")]
    assert best and set(best) <= {2, 4, 7, 9}
    saved = sorted(
        int(re.search(r"-i(\d+)", p.name).group(1)) for p in (tmp_path / "runs").rglob("ckpt-*") if p.is_dir()
    )
    assert saved == best


def test_early_stopping_stops_inside_an_epoch(tmp_path):
    plugins = """
    [plugins.early_stopping]
    monitor = "valid.loss"
    stopping_threshold = 100.0
    """
    config = write(tmp_path, "eval_every_n_batches = 2", plugins, '["early_stopping", "sqlite_log"]')
    result = epochal(tmp_path, "run", str(config))
    assert result.returncode == 0, result.stderr
    assert "after 0 epoch(s), 2 batch(es)" in result.stderr + result.stdout
    assert "stopping_threshold 100 in epoch 1 (after batch 2)" in result.stderr + result.stdout


def test_early_stoppings_reason_names_the_epoch_of_an_in_epoch_best(tmp_path):
    # evaluations at batches 7 and 14 of the run (epochs of 5 batches): in epochs 2 and 3; mode
    # "max" on a falling loss makes the first the best and the second a check without improvement
    plugins = """
    [plugins.early_stopping]
    monitor = "valid.loss"
    mode = "max"
    patience = 1
    """
    loop = "eval_every_n_batches = 7\neval_every_n_epochs = 0\nmax_epochs = 4"
    config = write(tmp_path, loop.replace("max_epochs = 4", ""), plugins, '["early_stopping", "sqlite_log"]')
    result = epochal(tmp_path, "run", str(config), "--set", "loop.max_epochs=4")
    assert result.returncode == 0, result.stderr
    output = " ".join((result.stderr + result.stdout).split())  # the summary wraps at $COLUMNS
    assert re.search(r"; best \d\.\d{1,4} in epoch 2 \(after batch 7\)", output), output
    assert "after 2 epoch(s), 14 batch(es)" in output
    assert "EarlyStoppingWarning" not in output  # the epochs without an evaluation are no warning


def test_an_evaluation_after_an_epochs_last_batch_is_checked_once(tmp_path):
    # mode "max" on a falling loss: every evaluation after the first is a check without
    # improvement; patience 2 stops at the third evaluation (batch 15), not at the second,
    # as it would if the epoch's end checked the same row again
    plugins = """
    [plugins.early_stopping]
    monitor = "valid.loss"
    mode = "max"
    patience = 2
    """
    config = write(tmp_path, "eval_every_n_batches = 5", plugins, '["early_stopping", "sqlite_log"]')
    result = epochal(tmp_path, "run", str(config), "--set", "loop.max_epochs=4")
    assert result.returncode == 0, result.stderr
    # the stop comes at a batch boundary (after batch 15), as a stop asked in after_batch does
    assert "15 batch(es): early_stopping: valid.loss did not increase" in result.stdout
    assert evaluated(tmp_path) == [5, 10, 15]


def test_a_plateau_schedule_steps_on_the_in_epoch_rows(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("epochal_schedule")
    plugins = """
    [plugins.lr_scheduler]
    name = "ReduceLROnPlateau"
    interval = "batch"
    monitor = "valid.loss"
    mode = "max"
    patience = 0
    factor = 0.5
    """
    config = write(tmp_path, "eval_every_n_batches = 2", plugins, '["lr_scheduler", "sqlite_log"]')
    result = epochal(tmp_path, "run", str(config))
    assert result.returncode == 0, result.stderr
    rates = {row["iteration"]: row["lr"] for row in rows(tmp_path) if "lr" in row}
    # mode "max" on a falling loss: every evaluation after the first halves the rate
    changed = [i for i in sorted(rates) if i > 1 and rates[i] != rates[i - 1]]
    assert changed == [5, 8, 10]  # the batches after the evaluations at 4, 7 and 9


def test_resumes_bitwise_right_after_an_in_epoch_evaluation(tmp_path):
    plugins = """
    [plugins.early_stopping]
    monitor = "valid.loss"
    patience = 1
    """
    config = write(tmp_path, "eval_every_n_batches = 2", plugins, '["early_stopping", "checkpoint"]')
    result = epochal(tmp_path, "check-resume", str(config), "--at", "4", "--set", "loop.max_epochs=3")
    assert result.returncode == 0, result.stderr
    assert "ok: interrupted after batch 4 of 15 and resumed" in result.stdout


@pytest.mark.parametrize(
    ("loop", "message"),
    [
        (
            "eval_every_n_batches = 0.5\neval_every_n_epochs = 0",
            "[loop]: eval_every_n_batches = 0.5 is a fraction of an epoch, and eval_every_n_epochs = 0 "
            "counts batches over the whole run: give a number of batches",
        ),
        ("eval_every_n_batches = 6", "eval_every_n_batches = 6 is more than the 5 batches of an epoch"),
        ("eval_every_n_batches = 1.5", "eval_every_n_batches"),
        ("eval_every_n_batches = 0", "eval_every_n_batches"),
    ],
)
def test_contradictions_are_one_line_before_the_first_batch(tmp_path, loop, message):
    result = epochal(tmp_path, "run", str(write(tmp_path, loop)))
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert "run.toml" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not (tmp_path / "runs" / "epochal.sqlite").exists()


def test_printing_shows_each_in_epoch_evaluation_with_its_batch(tmp_path):
    pytest.importorskip("epochal_printing")
    config = write(tmp_path, "eval_every_n_batches = 2", order='["printing"]')
    result = epochal(tmp_path, "run", str(config))
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stdout.splitlines() if "valid" in line and line.startswith("epoch ")]
    assert [line.split(":")[0] for line in lines] == [
        "epoch 1/2 batch 2 (iteration 2)",
        "epoch 1/2 batch 4 (iteration 4)",
        "epoch 2/2 batch 2 (iteration 7)",
        "epoch 2/2 batch 4 (iteration 9)",
    ]


@pytest.mark.distributed
def test_two_processes_evaluate_inside_epochs_and_resume_bitwise(tmp_path):
    # 5 batches shared by 2 processes, padded: 3 a rank, so half way (3) is an epoch's end and
    # the default point is batch 2, right after an in-epoch evaluation
    plugins = """
    [plugins.early_stopping]
    monitor = "valid.loss"
    patience = 3
    [plugins.checkpoint]
    every_n_batches = 1
    when = "valid.loss.best_so_far"
    """
    loop = 'eval_every_n_batches = 2\nuneven_shards = "pad"'
    config = write(tmp_path, loop, plugins, '["early_stopping", "checkpoint"]')
    result = epochal(tmp_path, "check-resume", str(config), "--nproc", "2")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "ok: interrupted after batch 2 of 6 and resumed (batch 2 of epoch 1)" in result.stdout
