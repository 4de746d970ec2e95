"""The model and data of the throwaway runs: epochal's tiny regression, with a slow step option."""

from __future__ import annotations

import time
from typing import Any

from epochal.examples.tiny import TinyModel, tiny_data


class Linear(TinyModel):
    """TinyModel whose train step can sleep (for the signal tests)."""

    def __init__(self, sleep: float = 0.0, seed: int = 0) -> None:
        super().__init__(seed=seed)
        self.sleep = sleep

    def train_step(self, batch: Any) -> dict[str, float]:
        if self.sleep:
            time.sleep(self.sleep)
        return super().train_step(batch)


def make_model(sleep: float = 0.0, seed: int = 0) -> Linear:
    return Linear(sleep, seed)


def make_data(n: int = 40, batch_size: int = 4, seed: int = 0) -> dict[str, Any]:
    return tiny_data(examples=n, batch_size=batch_size, seed=seed)
