"""``epochal log`` views for a person (issue 29), through the CLI at ``COLUMNS=80``.

The metrics come first (a running record, ``monitor``'s ``train.loss.running``, right after its
epoch record ``train.loss``) and the timing plugin's profiling records (``timing.*``) only on request
(``--timing``); ``log plot`` without ``--key`` draws the losses and the monitored metrics, with
their running records;
``log runs`` shows each run's config file and run directory, ``--config`` selects that config's
runs, and at 80 columns the table wraps onto blocks instead of dropping columns.
"""

from __future__ import annotations

import csv
import io
import json
import re
import subprocess
from pathlib import Path

import pytest

from epochal.testing import epochal_command

pytestmark = pytest.mark.slow

CONFIG = """
[loop]
max_epochs = 2
seed = 0

[model]
factory = "epochal.examples.digits:make_model"
hidden = 16

[data]
factory = "epochal.examples.digits:make_data"
batch_size = 256

[plugins]
order = ["monitor", "early_stopping", "timing", "sqlite_log"]
autoload = false

[plugins.monitor]
every_n_batches = 4  # 6 batches per epoch: a running record at 4, 8 and 12 (an epoch's last)

[plugins.early_stopping]
monitor = "valid.accuracy"
mode = "max"
patience = 5

[plugins.sqlite_log]
path = "runs/epochal.sqlite"
"""

ENV = {"EPOCHAL_DISABLE_PLUGIN_AUTOLOAD": "1"}


def epochal(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``epochal ARGS``: ``log`` at 80 columns; ``run`` without (its summary gives whole run ids)."""
    extra = {"EPOCHAL_PLUGINS": "sqlite_log", "COLUMNS": "80"} if args[0] == "log" else {}
    done = epochal_command(*args, cwd=cwd, env={**ENV, **extra})
    assert done.returncode == 0, done.stderr
    return done


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str], str]:
    """Two runs of digits.toml (under runs/digits, runs/again) and one of other.toml (runs/other)."""
    cwd = tmp_path_factory.mktemp("views")
    (cwd / "digits.toml").write_text(CONFIG)
    (cwd / "other.toml").write_text(CONFIG.replace("hidden = 16", "hidden = 8"))
    ids = []
    for args in (["digits.toml"], ["digits.toml", "--set", "loop.run_dir=runs/again"], ["other.toml"]):
        ids.append(epochal(cwd, "run", *args).stdout.split()[2])
    return cwd, ids[:2], ids[2]


def test_runs_shows_config_and_run_dir_within_80_columns(project: tuple[Path, list[str], str]) -> None:
    cwd, digits, other = project
    text = epochal(cwd, "log", "runs").stdout
    lines = text.splitlines()
    assert max(map(len, lines)) <= 80, text
    words = set(text.split())
    header = ("run_id", "status", "started", "duration", "epochs", "iterations", "config", "run_dir",
              "resumed_from", "reason")  # fmt: skip
    assert set(header) <= words, text  # no column dropped: the table wraps onto another block
    # each run's own directory under its config's run_dir
    assert {"digits.toml", "other.toml", "runs/digits/version_0", "runs/again/version_0"} <= words
    assert "runs/other/version_0" in words
    blocks = [block.splitlines() for block in text.split("\n\n")]
    assert len(blocks) > 1 and all(block[0].startswith("run_id") for block in blocks)
    for block in blocks:  # each block has a line per run, named by its 12-character id
        assert [line.split()[0] for line in block[1:]] == [run[:12] for run in [*digits, other]]

    chosen = epochal(cwd, "log", "runs", "--config", "other.toml").stdout
    assert other[:12] in chosen and not any(run[:12] in chosen for run in digits)
    listed = json.loads(epochal(cwd, "log", "runs", "--config", "digits.toml", "--json").stdout)
    assert [run["run_id"] for run in listed] == digits
    assert listed[0]["config"]["config_file"] == str((cwd / "digits.toml").resolve())


def test_show_puts_the_metrics_first_and_timing_behind_a_flag(project: tuple[Path, list[str], str]) -> None:
    cwd, _, other = project
    header = next(csv.reader(io.StringIO(epochal(cwd, "log", "show", other, "--csv").stdout)))
    assert header[:7] == ["iteration", "run_id", "epochs_done", "train.loss", "train.loss.running",
                          "valid.loss", "train.accuracy"]  # fmt: skip
    assert {"train.loss", "valid.loss", "valid.accuracy", "train.accuracy.running"} <= set(header)
    assert not [key for key in header if key.startswith("timing.")], header

    timed = next(csv.reader(io.StringIO(epochal(cwd, "log", "show", other, "--csv", "--timing").stdout)))
    profiling = [i for i, key in enumerate(timed) if key.startswith("timing.")]
    assert profiling and profiling == list(range(len(timed) - len(profiling), len(timed)))  # last
    assert timed[: profiling[0]] == header

    text = epochal(cwd, "log", "show", other).stdout  # the table: losses on the first screen
    assert max(map(len, text.splitlines())) <= 80
    assert "valid.loss" in text.split("\n\n")[0]


def test_compare_lists_the_metrics_first(project: tuple[Path, list[str], str]) -> None:
    cwd, digits, _ = project
    table = list(csv.reader(io.StringIO(epochal(cwd, "log", "compare", *digits, "--csv").stdout)))
    keys = [row[0] for row in table[1:]]
    assert keys[:3] == ["train.loss", "train.loss.running", "valid.loss"]  # the running record beside
    assert keys[keys.index("train.accuracy") :][:3] == [
        "train.accuracy",
        "train.accuracy.running",
        "valid.accuracy",
    ]
    assert not [key for key in keys if key.startswith("timing.")]
    timed = [row[0] for row in list(csv.reader(io.StringIO(
        epochal(cwd, "log", "compare", *digits, "--csv", "--timing").stdout)))[1:]]  # fmt: skip
    assert timed[: len(keys)] == keys and all(key.startswith("timing.") for key in timed[len(keys) :])
    assert len(timed) > len(keys)


def svg_texts(path: Path) -> set[str]:
    return set(re.findall(r">([^<>]+)</text>", path.read_text()))


def test_plot_draws_the_losses_and_the_monitored_metric_by_default(
    project: tuple[Path, list[str], str],
) -> None:
    pytest.importorskip("matplotlib")
    cwd, digits, _ = project
    epochal(cwd, "log", "plot", digits[0], "-o", "default.svg")
    texts = svg_texts(cwd / "default.svg")
    # the legends: the per-step curve of the loss with it (train.loss.running, in the loss panel)
    assert {"train.loss", "train.loss.running", "valid.loss", "valid.accuracy"} <= texts
    assert {"loss", "accuracy"} <= texts and "loss.running" not in texts  # two panels' titles
    assert not {"train.accuracy", "train.accuracy.running", "epochs_done"} & texts  # not monitored
    assert not [t for t in texts if "timing" in t or "after_batch" in t]

    epochal(cwd, "log", "plot", digits[0], "--all", "-o", "all.svg")
    everything = svg_texts(cwd / "all.svg")
    assert {"train.accuracy", "epochs_done"} <= everything
    assert not [t for t in everything if "timing" in t]
    epochal(cwd, "log", "plot", digits[0], "--timing", "-o", "timed.svg")
    assert [t for t in svg_texts(cwd / "timed.svg") if t.startswith("timing.")]
