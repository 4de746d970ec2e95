"""What a person sees from ``epochal run``: the epoch blocks on a terminal, the summary, the words
of --resume, a rerun into another run's checkpoints, --plugins versus --only, check-resume."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest

from epochal.testing import EpochalCli, digits_config

pytest_plugins = ["epochal.testing"]
pytestmark = pytest.mark.usefixtures("no_epochal_env")

STANDARD = ["monitor", "early_stopping", "checkpoint", "sqlite_log", "timing", "progress"]


def run_in_terminal(*args: str, cwd: Path, columns: int = 80) -> tuple[int, list[str]]:
    """Run ``epochal ARGS`` under a pseudo-terminal *columns* wide; return its status and lines."""
    status, text = terminal_output(*args, cwd=cwd, columns=columns)
    # what stays on screen: each \r-separated frame overwrites the line, the last one remains
    return status, [line.split("\r")[-1] for line in text.replace("\r\n", "\n").split("\n")]


def terminal_output(*args: str, cwd: Path, columns: int = 80) -> tuple[int, str]:
    """Run ``epochal ARGS`` under a pseudo-terminal *columns* wide; return its status and every
    character it wrote (escape sequences removed; a bar's frames separated by \r)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    env = {
        k: v for k, v in os.environ.items() if not k.startswith("EPOCHAL_") and k not in ("COLUMNS", "LINES")
    }
    process = subprocess.Popen(
        [sys.executable, "-m", "epochal", *args], cwd=cwd, stdin=slave, stdout=slave, stderr=slave, env=env
    )
    os.close(slave)
    out = b""
    while True:
        ready, _, _ = select.select([master], [], [], 120)
        if not ready:
            break
        try:
            chunk = os.read(master, 65536)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        out += chunk
    status = process.wait(timeout=60)
    os.close(master)
    return status, re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", out.decode("utf-8", "replace"))


def test_a_run_on_an_80_column_terminal(tmp_path: Path) -> None:
    digits_config(tmp_path / "run.toml", STANDARD, max_epochs=3, run_dir="runs/digits")
    status, lines = run_in_terminal("run", "run.toml", cwd=tmp_path)
    assert status == 0, "\n".join(lines)
    assert all(len(line) <= 80 for line in lines), lines  # the summary too (issue 29)
    for epoch in (1, 2, 3):
        start = next(i for i, line in enumerate(lines) if line.startswith(f"epoch {epoch}/3 · "))
        block = " ".join(lines[start : start + 3])
        assert re.search(r"train loss [0-9.]+ accuracy [0-9.]+", block), block
        # early stopping's best so far after the value (issue 47), not a metric of its own
        assert re.search(r"valid loss [0-9.]+( \(best( [0-9.]+)?\))? accuracy [0-9.]+", block), block
        # significant digits, never 0.00s: 42ms, 0.35ms, 1.25s
        assert re.search(r"· [1-9][0-9]*(\.[0-9]+)?m?s$|· 0\.0*[1-9][0-9]*m?s$", lines[start]), lines[start]
    text = "\n".join(lines)
    assert "stage / plugin.hook" not in text  # no profile unless asked
    # the run's id cut to 12 characters (the whole line would wrap at 80 columns)
    assert re.search(r"epochal: run [0-9a-f]{12} finished after 3 epoch\(s\), 69 batch\(es\)", text)
    text = text.replace(" \\\n    ", " ")  # a command wrapped with a shell continuation
    assert re.search(r"epochal: best valid: loss=[0-9.]+ \(epoch \d\), accuracy=[0-9.]+ \(epoch \d\)", text)
    assert "epochal: last train (epoch): loss=" in text
    assert "epochal: directory: runs/digits/version_0" in text
    assert "epochal: checkpoints: runs/digits/version_0/checkpoints" in text
    assert "epochal: log: runs/epochal.sqlite" in text
    assert "epochal: resume: epochal run run.toml --set loop.max_epochs=6 --resume" in text
    assert re.search(r"epochal: plot: epochal log plot \w+ --db \S+ --key valid.loss -o valid-loss.png", text)


def test_bars_and_metrics_at_80_columns(tmp_path: Path) -> None:
    """Issue 29: at 80 columns the bar shrank to one character and cut values (accuracy=0),
    flags (loss.best_so_far=true) read like metrics, metric order followed the model's."""
    extra = '[plugins.progress]\nmininterval = 0.0\n\n[plugins.early_stopping]\nmonitor = "valid.loss"\n'
    digits_config(tmp_path / "run.toml", STANDARD, max_epochs=2, extra=extra)
    status, text = terminal_output("run", "run.toml", cwd=tmp_path)
    assert status == 0, text
    frames = [frame for line in text.replace("\r\n", "\n").split("\n") for frame in line.split("\r")]
    bars = [frame for frame in frames if "batch/s" in frame or "it/s" in frame]
    assert bars, text  # mininterval = 0: every batch redraws
    for bar in bars:
        assert len(bar) <= 80, bar
        assert bar.rstrip().endswith("]"), bar  # nothing cut at the terminal's edge
        drawn = re.search(r"\|(.*)\|", bar)
        assert drawn is not None and len(drawn.group(1)) >= 10, bar  # the bar keeps its width
        for item in re.findall(r"(\w+)=([^,\]]*)", bar):
            assert re.fullmatch(r"-?[0-9.]+(e[-+][0-9]+)?", item[1]) and item[1] != "0", bar
    assert any("loss=" in bar for bar in bars), bars  # the loss fits beside the bar
    lines = [frame for frame in frames if frame and frame == frame.lstrip("\r")]
    assert not [line for line in lines if "best_so_far" in line or "=true" in line], lines
    summary = [line for line in lines if line.startswith("epochal: last") or line.startswith("epochal: best")]
    assert summary and all(re.search(r": loss=[^,]+, accuracy=", line) for line in summary), summary
    blocks = [line for line in lines if re.match(r"\s+(train|valid) loss ", line)]
    assert len(blocks) == 4, lines  # train and valid, each epoch: loss first, then accuracy


def test_the_summary_without_a_terminal(tmp_path: Path, epochal_cli: EpochalCli) -> None:
    digits_config(tmp_path / "run.toml", ["monitor", "checkpoint", "sqlite_log"], max_epochs=2)
    result = epochal_cli("run", "run.toml", "--set", "loop.seed=1")
    assert result.returncode == 0, result.stderr
    assert "epochal: checkpoints: " in result.stdout and "epochal: log: " in result.stdout
    assert (
        "epochal: resume: epochal run run.toml --set loop.seed=1 --set loop.max_epochs=4 --resume"
        in result.stdout
    )


def test_resume_says_what_it_resumed(tmp_path: Path, epochal_cli: EpochalCli) -> None:
    digits_config(tmp_path / "run.toml", ["monitor", "checkpoint"], max_epochs=2)
    first = epochal_cli("run", "run.toml")
    assert first.returncode == 0, first.stderr
    run_id = re.search(r"epochal: run (\w+) finished", first.stdout).group(1)  # type: ignore[union-attr]
    resumed = epochal_cli("run", "run.toml", "--set", "loop.max_epochs=3", "--resume")
    assert resumed.returncode == 0, resumed.stderr
    notes = [line for line in resumed.stderr.splitlines() if line.startswith("epochal: resumed from")]
    assert notes == [
        f"epochal: resumed from checkpoint {tmp_path / 'run/version_0/checkpoints/ckpt-e0002-i000046'} "
        f"of run {run_id} "
        f"at epoch 2, iteration 46 (this run: {notes[0].rsplit(' ', 1)[1][:-1]})"
    ]
    fresh = epochal_cli("run", "run.toml", "--set", "loop.run_dir=elsewhere")
    assert fresh.returncode == 0, fresh.stderr


def test_plugins_orders_and_only_selects(tmp_path: Path, epochal_cli: EpochalCli) -> None:
    help_text = epochal_cli("run", "--help").stdout
    assert "every other installed plugin" in help_text and "Load only these plugins" in help_text
    config = tmp_path / "run.toml"
    digits_config(config, [], max_epochs=1)
    config.write_text(config.read_text().replace("autoload = false", "autoload = true"))
    ordered = epochal_cli("run", "run.toml", "--plugins", "monitor", "--trace-plugins=trace.jsonl")
    assert ordered.returncode == 0, ordered.stderr
    only = epochal_cli("run", "run.toml", "--only", "monitor", "--set", "loop.run_dir=only")
    assert only.returncode == 0, only.stderr
    assert "epochal: checkpoints:" in ordered.stdout  # every installed plugin ran
    assert "epochal: checkpoints:" not in only.stdout and "epochal: log:" not in only.stdout
    assert "last train (epoch)" in only.stdout  # monitor ran
    both = epochal_cli("run", "run.toml", "--only", "monitor", "--plugins", "monitor")
    assert both.returncode == 2 and "--plugins and --only exclude each other" in both.stderr


def test_check_resume_speaks_for_itself(tmp_path: Path, epochal_cli: EpochalCli) -> None:
    digits_config(tmp_path / "run.toml", ["monitor", "checkpoint"], max_epochs=2)
    result = epochal_cli("check-resume", "run.toml", "--at", "10")
    assert result.returncode == 0, result.stderr
    assert "received" not in result.stderr and "SIGTERM received" not in result.stdout
    out = result.stdout
    assert "check-resume: 1/5 straight run" in out
    assert "check-resume: 2/5 the same run, stopped after batch 10 as SIGTERM stops it" in out
    assert "check-resume: 3/5 resuming it from its checkpoint" in out
    assert "check-resume: 4/5 the same run, ended after the end of epoch 1 as kill -9 ends it" in out
    assert "check-resume: 5/5 resuming it from its latest complete checkpoint" in out
    steps = [out.index(f"{k}/5") for k in range(1, 6)]
    assert steps == sorted(steps) and steps[-1] < out.index("ok: interrupted after batch 10")
    assert "received" not in out  # the kill -9 run says nothing of a signal either


@pytest.mark.slow
def test_metric_order_is_the_same_on_one_and_two_processes(tmp_path: Path, epochal_cli: EpochalCli) -> None:
    """Issue 29: the summary's and the epoch lines' metric order flipped between 1 and 2
    processes; every view now lists losses first, then alphabetically."""
    pytest.importorskip("torch")
    digits_config(tmp_path / "run.toml", ["monitor", "printing"], max_epochs=2, batch_size=256)
    orders = []
    for args in ([], ["--nproc", "2"]):
        where = f"loop.run_dir=run{len(args)}"
        done = epochal_cli("run", "run.toml", *args, "--set", where, env={"COLUMNS": "80"})
        assert done.returncode == 0, done.stderr
        assert all(len(line) <= 80 for line in done.stdout.splitlines()), done.stdout
        joined = done.stdout.replace("\n    ", " ").splitlines()  # a wrapped line is one again
        lines = [line for line in joined if line.startswith(("epoch ", "epochal: last"))]
        orders.append([re.findall(r"([\w.]+)=", line) for line in lines])
    assert orders[0] == orders[1] and orders[0], orders
    for names in orders[0]:
        for start in range(0, len(names), 2):  # per stream: loss, then accuracy
            assert names[start : start + 2] == ["loss", "accuracy"], names
