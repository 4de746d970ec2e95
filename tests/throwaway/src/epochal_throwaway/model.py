"""A tiny deterministic numpy model and data for quick runs."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from epochal.data import BatchStream


class Linear:
    def __init__(self, sleep: float = 0.0, seed: int = 0) -> None:
        self.w = np.random.default_rng(seed).normal(size=3)
        self.sleep = sleep

    def train_step(self, batch: Any) -> dict[str, float]:
        x, y = batch
        if self.sleep:
            time.sleep(self.sleep)
        error = x @ self.w - y
        self.w -= 0.1 * x.T @ error / len(x)
        return {"loss": float((error**2).mean())}

    def eval_step(self, batch: Any) -> dict[str, float]:
        x, y = batch
        return {"loss": float(((x @ self.w - y) ** 2).mean())}

    def state_dict(self) -> dict[str, Any]:
        return {"w": self.w.copy()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.w = np.array(state["w"], dtype=float)


def make_model(sleep: float = 0.0, seed: int = 0) -> Linear:
    return Linear(sleep, seed)


def make_data(n: int = 40, batch_size: int = 4, seed: int = 0) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 3))
    y = x @ np.array([1.0, -2.0, 0.5])
    return {
        "train": BatchStream(x, y, batch_size=batch_size, seed=seed),
        "valid": BatchStream(x[:8], y[:8], batch_size=batch_size, shuffle=False),
    }
