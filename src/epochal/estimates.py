"""How long a run will be, before it starts: ``loop.estimated_stepping_batches``.

Lightning's ``trainer.estimated_stepping_batches``: the optimizer steps a whole run takes,
for schedules that need a total (``OneCycleLR(total_steps=...)``, a cosine over the run). It
is the run's total, not what is left of it, so a resumed run builds its schedule as the first
run did.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["epoch_batches", "limit_ends_epoch", "stepping_batches"]


def stepping_batches(loop: Any) -> float:
    """The optimizer steps *loop* will take: ``math.inf`` when nothing bounds it.

    Training batches are ``max_iterations``, else ``max_epochs`` times the batches of this
    process's ``"train"`` stream (its ``len()``; without one the run is unbounded), whichever is
    smaller; with ``accumulate_grad_batches = N`` on the model, one step per N batches (the
    windows run across epoch boundaries, so a trailing partial window takes no step). A stop
    asked earlier (early stopping, a signal) makes the run shorter than the estimate.
    """
    bounds: list[float] = []
    if loop.max_iterations is not None:
        bounds.append(loop.max_iterations)
    if loop.max_epochs is not None:
        train = loop.data.get("train")
        sized = hasattr(type(train), "__len__")
        bounds.append(loop.max_epochs * len(train) if sized else math.inf)
    batches = min(bounds, default=math.inf)
    accumulate = getattr(loop.model, "accumulate_grad_batches", 1)
    if batches == math.inf:
        return math.inf
    return int(batches) // max(int(accumulate), 1)


def epoch_batches(loop: Any) -> int | None:
    """The training batches of one of *loop*'s epochs: ``epoch_size``, else the ``len()`` of this
    process's train stream (None: unknown, a stream without one)."""
    if loop.epoch_size:
        return int(loop.epoch_size)
    train = loop.data.get("train")
    if not hasattr(type(train), "__len__"):
        return None
    try:
        return len(train)
    except TypeError:
        return None


def limit_ends_epoch(loop: Any, limit: int) -> bool:
    """Whether the iteration limit *limit* that stops *loop* falls on an epoch's last batch: the
    epoch then finishes (its evaluation, ``after_epoch``), as Lightning's ``max_steps`` does. A
    train stream of unknown length leaves the epoch unfinished (only the next batch would tell)."""
    if loop.iteration < limit or loop.stopping.reason != f"max_iterations={limit} reached":
        return False
    return loop.batch_in_epoch == epoch_batches(loop)
