"""Trigger keys and gradient accumulation agree: ``before_optimizer_step`` is gated as the batch
hooks are, so a value kept there is written in the row of the batch that stepped (issue 47)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from epochal import Loop, hookimpl, load_plugins

torch = pytest.importorskip("torch")
from epochal.torch import TorchModel  # noqa: E402


class StepRecorder:
    """docs/pytorch.md's gradient-norm recipe, noting which batch's step it saw."""

    def __init__(self) -> None:
        self.step: int | None = None

    @hookimpl
    def before_optimizer_step(self, loop: Any, optimizer: Any) -> None:
        self.step = loop.iteration + 1  # the batch being run

    @hookimpl
    def after_batch(self, loop: Any) -> None:
        if self.step is not None:
            loop.log.current_row["stepped_at"], self.step = self.step, None


def run(every: dict[str, int], accumulate: int = 4, batches: int = 40) -> dict[int, int]:
    torch.manual_seed(0)
    module = torch.nn.Linear(3, 1)
    model = TorchModel(
        module,
        torch.optim.SGD(module.parameters(), lr=0.01),
        torch.nn.functional.mse_loss,
        device="cpu",
        accumulate_grad_batches=accumulate,
    )
    rng = np.random.default_rng(0)
    data = [
        (rng.standard_normal((4, 3)).astype("f4"), rng.standard_normal((4, 1)).astype("f4"))
        for _ in range(batches)
    ]
    plugins = load_plugins(autoload=False, extra={"steps": StepRecorder()}, options={"steps": every})
    loop = Loop(model, {"train": data}, plugins=plugins, max_epochs=1)
    loop.run()
    return {row: value for row, value in loop.log.history("stepped_at")}


def test_every_n_batches_gates_the_optimizer_step_hook_as_the_batch_hooks() -> None:
    # steps at batches 4, 8, ..., 40; every 10 batches: the steps of batches 20 and 40 only,
    # each in its own row (batch 8's step was written into row 10, batch 28's into row 30)
    assert run({"every_n_batches": 10}) == {20: 20, 40: 40}


def test_every_n_optimizer_steps_is_every_n_times_accumulation_batches() -> None:
    # "every 5 optimizer steps" with accumulate_grad_batches = 4: every_n_batches = 20
    assert run({"every_n_batches": 20}) == {20: 20, 40: 40}
    assert run({}) == {n: n for n in range(4, 41, 4)}  # ungated: every step
