"""A plugin that reads the full weights with ``epochal.torch.full_weights`` on every rank at each
epoch's end (``test_torch_full_weights.py``), and writes what each rank got."""

from __future__ import annotations

import json
from typing import Any

from epochal import hookimpl
from epochal.torch import full_weights


class Weights:
    """Writes ``weights-<rank>.json``: per epoch, the weights rank 0 got (None on the others)."""

    rank = "all"  # the gather needs every rank

    def __init__(self) -> None:
        self.got: list[Any] = []

    @hookimpl
    def after_epoch(self, loop: Any) -> None:
        weights = full_weights(loop.model)  # every rank, at the same point
        self.got.append(None if weights is None else {k: v.tolist() for k, v in weights.items()})

    @hookimpl
    def after_training(self, loop: Any) -> None:
        with open(f"weights-{loop.world.rank}.json", "w", encoding="utf-8") as out:
            json.dump({"got": self.got, "sharded": loop.model.sharded}, out)
