"""Helpers of the multi-process tests: find a launcher's workers, wait for a condition.

Their run configurations come from ``ddp_tiny.write_config`` (the bench scripts use it too)."""

from __future__ import annotations

import subprocess
import time
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
