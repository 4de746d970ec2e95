"""A training command outlives the reader of its output (`epochal run ... | head -1`)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("epochal_checkpoint")  # installed with every plugin by tox
pytestmark = pytest.mark.skipif(os.name != "posix", reason="SIGPIPE is POSIX's")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "digits.toml"


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("EPOCHAL_")}


def _epochal(*args: str, **kwargs) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "epochal", *args], env=_env(), text=True, **kwargs)


@pytest.mark.parametrize("both", [False, True], ids=["stdout", "stdout-and-stderr"])
def test_run_trains_to_the_end_when_its_reader_goes_away(tmp_path: Path, both: bool) -> None:
    run_dir, config = tmp_path / "runs", tmp_path / "digits.toml"  # its log: beside the config
    config.write_text(EXAMPLE.read_text())
    process = _epochal(
        "run", str(config), "--set", "loop.max_epochs=3", "--set", f"loop.run_dir={run_dir.as_posix()}",
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT if both else subprocess.PIPE,
    )  # fmt: skip
    assert process.stdout is not None
    first = process.stdout.readline()  # what `| head -1` reads, then it goes away
    process.stdout.close()
    err = process.stderr.read() if process.stderr else ""
    code = process.wait(timeout=240)
    assert "training: run" in first
    assert code == 0, err  # not 128 + SIGPIPE: killed between two batches
    checkpoints = sorted(p.name for p in (run_dir / "version_0" / "checkpoints").glob("ckpt-*"))
    assert [name.split("-")[1] for name in checkpoints] == ["e0001", "e0002", "e0003"]
    listed = subprocess.run(
        [sys.executable, "-m", "epochal", "log", "runs", "--json", "--db", str(tmp_path / "epochal.sqlite")],
        env=_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert listed.returncode == 0, listed.stderr
    (run,) = json.loads(listed.stdout)
    assert (run["status"], run["epochs_done"]) == ("finished", 3)
    if not both:
        assert "stdout was closed by its reader; the run goes on without it" in err


def test_a_listing_still_ends_quietly_on_a_closed_pipe(tmp_path: Path) -> None:
    process = _epochal("hooks", cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert process.stdout is not None and process.stderr is not None
    process.stdout.readline()
    process.stdout.close()
    err = process.stderr.read()
    code = process.wait(timeout=120)
    assert code in (0, -signal.SIGPIPE), err  # done before the reader left, or ended by SIGPIPE
    assert "Traceback" not in err and "BrokenPipeError" not in err
