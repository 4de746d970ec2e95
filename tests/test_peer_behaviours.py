"""Where epochal behaves as its peers do (Lightning, Ignite, Keras), through the Python API.

Each case names the peer's behaviour it follows; docs/migrating.md lists where epochal differs.
"""

from __future__ import annotations

from typing import Any

from epochal import Loop, hookimpl
from epochal.examples.tiny import TinyModel, tiny_data


class Calls:
    """Counts ``after_epoch`` calls and notes the evaluations' iterations."""

    def __init__(self) -> None:
        self.epochs: list[int] = []
        self.evaluated: list[int] = []

    @hookimpl
    def after_epoch(self, loop: Any) -> None:
        self.epochs.append(loop.epoch)

    @hookimpl
    def after_evaluation(self, loop: Any) -> None:
        self.evaluated.append(loop.iteration)


def run(max_iterations: int, **options: Any) -> tuple[Loop, Calls]:
    calls = Calls()
    data = tiny_data(examples=40, batch_size=8)  # 5 batches an epoch
    loop = Loop(TinyModel(), data, plugins={"calls": calls}, max_iterations=max_iterations, **options)
    loop.run()
    return loop, calls


def test_max_iterations_on_an_epochs_last_batch_finishes_that_epoch() -> None:
    # Lightning: max_steps reached on an epoch's last batch still runs the validation and the
    # epoch-end callbacks, and current_epoch counts the epoch
    loop, calls = run(10, max_epochs=5)
    assert loop.epoch == 2 and loop.iteration == 10 and not loop.in_epoch
    assert calls.epochs == [1, 2] and calls.evaluated == [5, 10]
    assert loop.log.status["finish_reason"] == "max_iterations=10 reached"
    assert loop.log.status["epochs_done"] == 2


def test_max_iterations_inside_an_epoch_leaves_it_unfinished() -> None:
    loop, calls = run(7)
    assert loop.epoch == 1 and loop.iteration == 7 and loop.in_epoch
    assert calls.epochs == [1] and calls.evaluated == [5]


def test_with_an_epoch_size_the_limit_on_its_last_batch_finishes_the_epoch() -> None:
    loop, calls = run(6, epoch_size=3)
    assert loop.epoch == 2 and calls.epochs == [1, 2] and calls.evaluated == [3, 6]
