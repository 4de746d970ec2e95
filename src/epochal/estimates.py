"""How long a run will be, before it starts: ``loop.estimated_stepping_batches``.

Lightning's ``trainer.estimated_stepping_batches``: the optimizer steps a whole run takes,
for schedules that need a total (``OneCycleLR(total_steps=...)``, a cosine over the run). It
is the run's total, not what is left of it, so a resumed run builds its schedule as the first
run did.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["stepping_batches"]


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
