"""A finished run stays finished (issue 44, item 8): a SIGINT that reaches the loop's handler
once ``after_training`` ran to its end (its final checkpoint written) is only noted; one during
``after_training`` still stops at once, and the loop says training had ended."""

from __future__ import annotations

import signal
from typing import Any

import pytest

from epochal import Loop, hookimpl
from epochal.examples.tiny import TinyModel, tiny_data


class Final:
    """Records that its after_training ran (a final checkpoint is written there)."""

    def __init__(self, sigints: int = 0) -> None:
        self.sigints = sigints
        self.done = False

    @hookimpl
    def after_training(self, loop: Any) -> None:
        for _ in range(self.sigints):
            loop.stopping.interrupt(signal.SIGINT)
        self.done = True


def test_three_sigints_after_the_final_hooks_leave_the_run_finished(
    capsys: pytest.CaptureFixture[str],
) -> None:
    final = Final()
    loop = Loop(TinyModel(), tiny_data(), plugins={"final": final}, max_epochs=2, handle_signals=False)
    log = loop.run()
    assert final.done and loop.wound_down
    for _ in range(3):  # what the handler Loop.run installs does with a signal received late
        loop._on_signal(signal.SIGINT, None)
    assert log.status["status"] == "finished" and log.status["finish_reason"] == "max_epochs=2 reached"
    said = capsys.readouterr().err.splitlines()
    assert said == ["epochal: SIGINT received after training ended; the run's outcome stands"] * 3


def test_a_third_sigint_during_after_training_says_training_had_ended() -> None:
    loop = Loop(
        TinyModel(), tiny_data(), plugins={"final": Final(sigints=3)}, max_epochs=2, handle_signals=False
    )
    with pytest.raises(KeyboardInterrupt):
        loop.run()
    assert loop.training_ended and not loop.wound_down and not loop.interrupt_hooks_ran
