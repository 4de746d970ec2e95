"""A plugin that counts torch.distributed's collectives by stage (copied beside a test's config).

It wraps the process-group primitives (``all_reduce``, ``all_gather``, ``broadcast``, ``barrier``
…) in both of torch's namespaces, so ``all_gather_object`` counts as the two all-gathers it
makes; each call is counted under the stage the loop is in (``step``: from a batch's
``before_batch`` to the next stage) and the training step it belongs to. At the end of training
each rank writes ``collectives-<rank>.json``.
"""

from __future__ import annotations

import functools
import json
from typing import Any

from epochal import hookimpl

PRIMITIVES = ("all_reduce", "all_gather", "broadcast", "barrier", "reduce", "gather", "scatter", "all_to_all")


class Phases:
    """Names the stage the loop is in (``phase``) and the training step (``iteration``)."""

    def __init__(self) -> None:
        self.phase, self.iteration = "start", 0

    @hookimpl(tryfirst=True)
    def before_batch(self, loop: Any) -> None:
        self.phase, self.iteration = "step", loop.iteration + 1

    @hookimpl(tryfirst=True)
    def before_evaluation(self) -> None:
        self.phase = "evaluation"

    @hookimpl(tryfirst=True)
    def after_epoch(self) -> None:
        self.phase = "epoch end"

    @hookimpl(tryfirst=True)
    def after_training(self) -> None:
        self.phase = "end"


class CountCollectives(Phases):
    """Counts every collective of this rank, with the stage and the step it was made in."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, int, str]] = []
        self._undo: list[tuple[Any, str, Any]] = []

    def _wrap(self, function: Any, name: str) -> Any:
        @functools.wraps(function)
        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls.append((self.phase, self.iteration, name))
            return function(*args, **kwargs)

        return counted

    @hookimpl(tryfirst=True)
    def before_training(self) -> None:
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        for name in PRIMITIVES:
            original = getattr(c10d, name)
            counted = self._wrap(original, name)
            for module in (dist, c10d):
                self._undo.append((module, name, getattr(module, name)))
                setattr(module, name, counted)

    @hookimpl(trylast=True)
    def after_training(self, loop: Any) -> None:  # type: ignore[override]
        for module, name, original in reversed(self._undo):
            setattr(module, name, original)
        report = {
            "every": getattr(loop.stopping, "every", None),
            "steps": loop.iteration,
            "calls": self.calls,
        }
        with open(f"collectives-{loop.world.rank}.json", "w", encoding="utf-8") as out:
            json.dump(report, out)
