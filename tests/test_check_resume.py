"""`epochal check-resume` on the example config and on a plugin that forgets its state."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("epochal_checkpoint")  # installed with every plugin by tox

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "digits.toml"


def test_example_config_resumes_bitwise(tmp_path):
    # batch 30 is inside the monitor's first window (a running record every 50 batches by
    # default): the log rows compared bitwise include train.*.running at 50, the window resumed
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPOCHAL_")}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "epochal",
            "check-resume",
            str(EXAMPLE),
            "--at",
            "30",
            "--set",
            "loop.max_epochs=3",
            "--disable",
            "progress",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    assert "ok: interrupted after batch 30 of 69 and resumed" in result.stdout
    assert "left out (not deterministic): timing" in result.stdout
    assert not (tmp_path / "runs").exists()  # every run used its own temporary run directory


def test_a_plugin_that_forgets_its_state_is_named(throwaway_cli, write_config):
    config = write_config(["tw_forgetful", "checkpoint"])
    result = throwaway_cli("check-resume", str(config), "--at", "3")
    assert result.returncode == 1, result.stderr
    assert "MISMATCH after resuming at batch 3: plugins.tw_forgetful.count" in result.stderr
    assert "straight run has 8, resumed run has 5" in result.stderr


@pytest.mark.parametrize("after", [True, False], ids=["after-checkpoint", "before-checkpoint"])
def test_a_state_changed_in_after_epoch_after_the_checkpoint_is_named(throwaway_cli, write_config, after):
    # the SIGTERM check cannot see it (the interrupt checkpoint comes after every after_epoch);
    # a run ended after an epoch's end as kill -9 ends it, and resumed, does
    order = ["checkpoint", "counter"] if after else ["counter", "checkpoint"]
    config = write_config(order, extra='[plugins.counter]\nfactory = "epoch_counter:EpochCounter"\n')
    shutil.copy(Path(__file__).with_name("epoch_counter.py"), config.parent)
    result = throwaway_cli("check-resume", str(config))
    if after:
        assert result.returncode == 1, result.stderr
        assert "ok: interrupted after batch 3 of 8 and resumed" in result.stdout  # the SIGTERM check passes
        assert (
            "MISMATCH: ended after epoch 1 as kill -9 ends it and resumed from its latest complete "
            "checkpoint (batch 4): plugins.counter.epochs: straight run has 2, resumed run has 1"
        ) in result.stderr
        assert "order it before 'checkpoint'" in result.stderr
    else:
        assert result.returncode == 0, result.stderr
        assert (
            "ok: ended after epoch 1 as kill -9 ends it and resumed from its latest complete "
            "checkpoint (batch 4): it matches the straight run bitwise"
        ) in result.stdout


def test_a_run_with_no_checkpoint_by_the_kill_reruns_afresh_and_says_so(throwaway_cli, write_config):
    config = write_config(["checkpoint"], extra="[plugins.checkpoint]\nevery_n_epochs = 5\n")
    result = throwaway_cli("check-resume", str(config))
    assert result.returncode == 0, result.stderr
    assert (
        "ok: ended after epoch 1 as kill -9 ends it and resumed afresh (no checkpoint was saved"
        in result.stdout
    )


def test_at_out_of_range_is_a_clear_error(throwaway_cli, write_config):
    result = throwaway_cli("check-resume", str(write_config(["checkpoint"])), "--at", "99")
    assert result.returncode == 2
    assert "Error: --at must be between 1 and 7" in result.stderr


def test_needs_a_checkpoint_plugin(throwaway_cli, write_config):
    result = throwaway_cli("check-resume", str(write_config(["tw_alpha"])))
    assert result.returncode == 2
    assert "needs a plugin that saves and restores checkpoints" in result.stderr


TWO_EPOCHS = """\
[loop]
max_epochs = 2
seed = 0
[model]
factory = "epochal.examples.tiny:TinyModel"
[data]
factory = "epochal.examples.tiny:tiny_data"
examples = {examples}
batch_size = 8
[plugins]
order = ["checkpoint"]
autoload = false
"""


@pytest.mark.parametrize(
    ("examples", "expected"),
    [
        # 2 epochs of 4 batches: half way (4) is the end of epoch 1; 3 is inside it
        (32, "interrupted after batch 3 of 8 and resumed (batch 3 of epoch 1)"),
        # 2 epochs of 5 batches: half way (5) is an epoch end too; 4 is the nearest inside
        (40, "interrupted after batch 4 of 10 and resumed (batch 4 of epoch 1)"),
    ],
)
def test_the_default_point_is_inside_an_epoch(tmp_path, examples, expected):
    config = tmp_path / "run.toml"
    config.write_text(TWO_EPOCHS.format(examples=examples))
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPOCHAL_")}
    result = subprocess.run(
        [sys.executable, "-m", "epochal", "check-resume", str(config)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert f"ok: {expected}" in result.stdout


def test_the_interruption_point_rule():
    from epochal.resumecheck import interruption_point

    assert interruption_point(10, [5, 10]) == 4  # never an epoch end while a batch is inside one
    assert interruption_point(9, [3, 6, 9]) == 4
    assert interruption_point(7, []) == 3  # no epoch ended (max_iterations): half way
    assert interruption_point(4, [1, 2, 3, 4]) == 2  # one batch an epoch: no inside point
