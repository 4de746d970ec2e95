"""A plugin that makes a process linger after training (copied beside a test's config).

In its ``after_training`` hook (phase ``after_training``), its ``run_summary`` hook (phase
``summary``) or in an ``atexit`` function (phase ``exit``: the interpreter's exit), on rank
*rank*, it writes ``lingering-RANK`` and sleeps *seconds*, so that a test can send a signal
during the wind-down. ``sigterm_at = N`` also interrupts the run by a SIGTERM to its own
process (rank *rank*'s) after batch N.
"""

from __future__ import annotations

import atexit
import os
import signal
import time
from pathlib import Path
from typing import Any

from epochal import hookimpl


class Linger:
    """Linger after training (see the module's docstring)."""

    def __init__(self, phase: str = "exit", rank: int = 0, seconds: float = 3.0, sigterm_at: int = 0) -> None:
        self.phase, self.rank, self.seconds, self.sigterm_at = phase, rank, seconds, sigterm_at

    @hookimpl
    def after_batch(self, loop: Any) -> None:
        if loop.iteration == self.sigterm_at and loop.world.rank == self.rank:  # a SIGTERM to itself
            os.kill(os.getpid(), signal.SIGTERM)

    def linger(self) -> None:
        Path(f"lingering-{self.rank}").write_text("now")
        time.sleep(self.seconds)

    @hookimpl
    def after_training(self, loop: Any) -> None:
        if self.phase == "exit" and loop.world.rank == self.rank:
            atexit.register(self.linger)
        if self.phase == "after_training" and loop.world.rank == self.rank:
            self.linger()

    @hookimpl
    def run_summary(self, loop: Any) -> list[str]:
        if self.phase == "summary":
            self.linger()
        return []
