"""Crash torture: ``epochal run`` killed with SIGKILL at random moments, 50 times.

Five runs (alternating synchronous and asynchronous saves, a checkpoint after every batch of a
4 MB model) are each killed 10 times, restarted with ``--resume`` after every kill. After every
kill, every checkpoint under a final name must verify and ``latest`` must name one of them; at
the end each run resumes once more and must match a straight run bitwise. bench/torture_checkpoint.py
runs more kills.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from epochal_checkpoint import list_checkpoints, load_latest
from epochal_checkpoint.testing import TORTURE_CONFIG, torture


def test_fifty_kills_leave_loadable_checkpoints_and_resume_works(tmp_path: Path) -> None:
    report = torture(tmp_path, chains=5, kills=10, size=1_000_000, parallel=2, seed=1)
    assert report.failures == []
    assert report.kills == 50
    assert report.final_runs == report.exact_matches == 5
    assert report.resumes > 0 and report.checkpoints_verified > 0


def test_sigterm_saves_an_interrupt_checkpoint_and_resume_continues(tmp_path: Path) -> None:
    (tmp_path / "run.toml").write_text(TORTURE_CONFIG.format(size=100_000, every=0, async_save="true"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPOCHAL_")}
    command = [sys.executable, "-c", "from epochal.cli import main; main()", "run", "run.toml"]
    proc = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    directory = tmp_path / "run" / "version_0" / "checkpoints"
    deadline = time.monotonic() + 60
    while not list_checkpoints(directory)[0] and time.monotonic() < deadline:  # an epoch checkpoint
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err
    stopped_at = int(re.search(r"(\d+) batch\(es\)", out.decode()).group(1))
    state, info = load_latest(directory)
    # the state the signal stopped at is saved (by on_interrupt, or already by after_epoch when
    # the signal arrived during the epoch's end: the same counters are not saved twice)
    assert state["iteration"] == stopped_at
    if info.manifest["reason"] == "interrupt":
        assert state["log"]["status"]["status"] == "interrupted"
    target = state["iteration"] + 5
    resumed = subprocess.run(
        [*command, "--resume", "--set", f"loop.max_iterations={target}"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert resumed.returncode == 0, resumed.stderr
    assert f"{target} batch(es)" in resumed.stdout
    assert load_latest(directory)[1].manifest["resumed_from"] == info.manifest["run_id"]
