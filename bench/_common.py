"""Pieces the bench scripts share: a no-op model, quiet output, versions, argument types, ports.

Imported by the scripts beside it (``sys.path`` holds ``bench/`` when a script runs); it runs
nothing itself.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import os
import socket
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np


class NoOpModel:
    """An epochal model whose steps do no work: each returns the same outputs.

    :param outputs: what every train step returns (default ``{"loss": 0.0}``).
    :param eval_outputs: what every eval step returns (default: *outputs*).
    :param array_state: a 2-float array as its state (saved and loaded), else an empty state.
    """

    def __init__(
        self,
        outputs: Mapping[str, Any] | None = None,
        eval_outputs: Mapping[str, Any] | None = None,
        array_state: bool = False,
    ) -> None:
        self.outputs = dict(outputs) if outputs is not None else {"loss": 0.0}
        self.eval_outputs = dict(eval_outputs) if eval_outputs is not None else self.outputs
        self.w = np.zeros(2, np.float32) if array_state else None

    def train_step(self, batch: Any) -> Mapping[str, Any]:
        return self.outputs

    def eval_step(self, batch: Any) -> Mapping[str, Any]:
        return self.eval_outputs

    def state_dict(self) -> dict[str, Any]:
        return {"w": self.w} if self.w is not None else {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if self.w is not None:
            self.w = state["w"]


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Send stdout and stderr (progress bars, tables, warnings) to os.devnull."""
    with (
        open(os.devnull, "w") as devnull,
        contextlib.redirect_stdout(devnull),
        contextlib.redirect_stderr(devnull),
    ):
        yield


def version(dist: str) -> str:
    """The installed version of *dist*, or 'absent'."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def rounds(text: str) -> int:
    """The ``--rounds`` option's type in the bench scripts: a whole number, at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def fsync_path(path: str | os.PathLike[str]) -> None:
    """fsync the file or directory at *path* (opened read-only: enough for fsync on Linux)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
