"""Checkpoints as ``numpy.save`` files: ``<run_dir>/npy/npy-<iteration>.npy``, one per epoch end.

A third party's plugin (trusted files only: the state is pickled inside the ``.npy``).
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path
from typing import Any

import numpy as np

from epochal import hookimpl
from epochal.errors import EpochalError

PREFIX = "npy-"


class NpyCheckpoint:
    """Save the loop's state after every epoch and on an interrupt; resume the newest."""

    rank = "all"  # loop.state_dict() is a collective on several processes
    provides = "checkpoint"  # installed with the standard one, it runs instead
    writes_to = ("directory",)  # the option naming where it writes (check-resume moves it)

    def __init__(self, directory: str | None = None) -> None:
        self.directory = directory

    def _directory(self, run_dir: Any) -> Path | None:
        if self.directory:
            return Path(self.directory)
        return Path(run_dir) / "npy" if run_dir is not None else None

    def _saved(self, run_dir: Any) -> list[Path]:
        directory = self._directory(run_dir)
        return sorted(directory.glob(f"{PREFIX}*.npy")) if directory and directory.is_dir() else []

    def _save(self, loop: Any) -> None:
        state = loop.state_dict()  # on every rank
        directory = self._directory(loop.run_dir)
        if not loop.world.is_zero or directory is None:
            return
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"{PREFIX}{loop.iteration:08d}.npy"
        partial = path.with_name(path.name + ".partial")
        with open(partial, "wb") as file:
            np.save(file, np.array([state], dtype=object), allow_pickle=True)
            file.flush()
            os.fsync(file.fileno())
        os.replace(partial, path)

    @hookimpl
    def after_epoch(self, loop: Any) -> None:
        self._save(loop)

    @hookimpl
    def on_interrupt(self, loop: Any) -> None:
        self._save(loop)

    @hookimpl
    def resume_state(self, loop: Any, resume: bool) -> Any:
        if not resume:
            return None
        mode = loop.resume if isinstance(loop.resume, str) else "latest"
        if mode in ("latest", "auto"):
            saved = self._saved(loop.run_dir)
            if not saved:
                if mode == "auto":
                    return None
                raise EpochalError(f"npy_checkpoint: no checkpoint in {self._directory(loop.run_dir)}")
            path = saved[-1]
        else:
            path = Path(mode)
        state = np.load(path, allow_pickle=True)[0]
        loop.resumed_source = f"checkpoint {path}"
        return state

    @hookimpl
    def run_summary(self, loop: Any) -> list[str]:
        lines = [f"checkpoints: {self._directory(loop.run_dir)}"]
        if loop.command:
            lines.append("resume: " + shlex.join([*loop.command, "--resume"]))
        return lines

    @hookimpl
    def latest_checkpoint(self, run_dir: Any) -> str | None:
        saved = self._saved(run_dir)
        return str(saved[-1]) if saved else None

    @hookimpl
    def check_fresh_run(self, run_dir: Any, command: list[str]) -> str | None:
        saved = self._saved(run_dir)
        if not saved:
            return None
        return (
            f"npy_checkpoint: {self._directory(run_dir)} holds {len(saved)} checkpoint(s) of an earlier "
            f"run. To continue it: {shlex.join([*command, '--resume'])}; to start afresh, choose "
            "another run_dir"
        )
