"""Helpers of the multi-process tests: find a launcher's workers, wait for a condition."""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest


def worker_pids(launcher: int) -> dict[int, int]:
    """rank → pid of the launcher's worker processes (read from /proc)."""
    found: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if parent != launcher:
                continue
            env = dict(
                item.split("=", 1) for item in (entry / "environ").read_text().split("\0") if "=" in item
            )
        except (OSError, ValueError, IndexError):
            continue
        if "RANK" in env:
            found[int(env["RANK"])] = int(entry.name)
    return found


def wait_for(condition: Any, timeout: float = 60, process: subprocess.Popen[str] | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if process is not None and process.poll() is not None:
            out, err = process.communicate()
            pytest.fail(f"the run ended early ({process.returncode}): {out}\n{err}")
        if time.monotonic() > deadline:
            pytest.fail("timed out waiting")
        time.sleep(0.05)


HERE = Path(__file__).resolve().parent


def tiny_ddp_config(
    directory: Path, plugins: Sequence[str], *, max_epochs: int = 3, tables: str = "", extra: str = ""
) -> Path:
    """*directory*/run.toml: ``tests/ddp_tiny.py``'s model and data on gloo (the module copied
    beside it), *plugins* in that order and nothing autoloaded, the ``where`` probe plugin;
    *tables* (TOML tables) before the probe's, *extra* appended after it."""
    shutil.copy(HERE / "ddp_tiny.py", directory / "ddp_tiny.py")
    config = directory / "run.toml"
    config.write_text(
        f"""[loop]
max_epochs = {max_epochs}
seed = 0
run_dir = "run"

[distributed]
backend = "gloo"
timeout = 60

[model]
factory = "ddp_tiny:make_model"

[data]
factory = "ddp_tiny:make_data"

[plugins]
order = {list(plugins)!r}
autoload = false
{tables}
[plugins.where]
factory = "ddp_tiny:Where"
"""
        + extra,
        encoding="utf-8",
    )
    return config
