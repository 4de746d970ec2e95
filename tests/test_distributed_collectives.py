"""Collectives per training step on 2 real processes (``epochal run --nproc 2``, gloo over loopback).

The run trains ``ddp_tiny.py``'s data-parallel regression with the six standard plugins (the
monitor writing a running record every batch, or every 50 by its default) and
``collective_counter.py``, which counts torch.distributed's primitives on each rank by stage.
Beyond the model's own gradient all-reduce (one per step), a step makes at most one collective
per n steps once the agreement has chosen n (issue 32); the monitor's reduce = "step" is what
asks for one per step.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ddp_tiny import write_config

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

HERE = Path(__file__).parent
#: the agreement's calibration: batches agreed one by one, the timed round trips, the proposal
CALIBRATION_BATCHES, ROUND_TRIPS = 16, 5
SIX = ["monitor", "early_stopping", "checkpoint", "sqlite_log", "timing", "progress"]


def run_counted(tmp_path: Path, monitor: str, running: str = "every_n_batches = 1") -> list[dict[str, Any]]:
    tables = f"""
[plugins.monitor]
{running}
{monitor}

[plugins.early_stopping]
monitor = "valid.loss"

[plugins.count]
factory = "collective_counter:CountCollectives"
"""
    examples = "examples = 1024     # 128 batches of 4 per rank and epoch\n"
    config = write_config(
        tmp_path, [*SIX, "count"], max_epochs=2, data=examples, tables=tables, probe=False,
        helpers=["collective_counter.py"],
    )  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPOCHAL_")}
    done = subprocess.run(
        [sys.executable, "-m", "epochal", "run", str(config), "--nproc", "2"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return [json.loads((tmp_path / f"collectives-{rank}.json").read_text()) for rank in (0, 1)]


def step_collectives(report: dict[str, Any]) -> tuple[list[int], int]:
    """The steps of the collectives made during training steps, and how many steps there were."""
    return [i for phase, i, _ in report["calls"] if phase == "step"], report["steps"]


@pytest.mark.parametrize("running", ["every_n_batches = 1", ""])  # "": the default, every 50
def test_the_six_standard_plugins_add_at_most_one_collective_per_n_steps(tmp_path, running):
    reports = run_counted(tmp_path, "", running)
    for report in reports:
        steps_of, steps = step_collectives(report)
        every = report["every"]
        assert steps == 256 and every >= 1
        per_step = {i: steps_of.count(i) for i in range(1, steps + 1)}
        assert all(count >= 1 for count in per_step.values())  # the model's gradient all-reduce
        extra = {i: count - 1 for i, count in per_step.items() if count > 1}
        steady = {i: count for i, count in extra.items() if i > CALIBRATION_BATCHES}
        # after the calibration: one agreement every n steps, at the multiples of n, nothing else
        assert all(i % every == 0 for i in steady)
        assert sum(steady.values()) == steps // every - CALIBRATION_BATCHES // every <= steps / every
        # the calibration's one-off: one agreement per batch, its round trips and the proposal
        calibration = sum(count for i, count in extra.items() if i <= CALIBRATION_BATCHES)
        assert calibration <= CALIBRATION_BATCHES - 1 + ROUND_TRIPS + 1
    assert reports[0]["every"] == reports[1]["every"]  # agreed
    shown = subprocess.run(
        [sys.executable, "-m", "epochal", "log", "show", "latest", "--config", "run.toml", "--keys",
         "train.loss.running", "--json"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    written = [row["iteration"] for row in json.loads(shown.stdout)["rows"]]
    assert written == list(range(1, 257) if running else range(50, 257, 50))  # rank 0's records


def test_the_monitors_reduce_step_is_what_asks_for_collectives_per_step(tmp_path):
    for report in run_counted(tmp_path, 'reduce = "step"'):
        steps_of, steps = step_collectives(report)
        # the gradient, and the running record's all_gather_object (two all-gathers) every step
        assert len(steps_of) >= 3 * steps
