"""A tiny deterministic regression and its data: quick runs for tests, benchmarks and demos."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from epochal.data import BatchStream


class TinyModel:
    """Linear regression trained by SGD: deterministic, fast, with a real state."""

    def __init__(self, features: int = 3, lr: float = 0.1, seed: int = 0) -> None:
        self.w = np.random.default_rng(seed).normal(size=features)
        self.lr = lr
        self.world: Any = None

    def distribute(self, world: Any) -> None:
        """Train with the other ranks of *world*: rank 0's weights, gradients averaged."""
        self.w = np.array(world.broadcast_object(self.w), dtype=float)
        self.world = world if world.size > 1 else None

    def train_step(self, batch: Any) -> dict[str, float]:
        x, y = batch
        error = x @ self.w - y
        grad = x.T @ error / len(x)
        if self.world is not None:
            grad = self.world.all_reduce_arrays([grad])[0] / self.world.size
        self.w = self.w - self.lr * grad
        return {"loss": float((error**2).mean())}

    def eval_step(self, batch: Any) -> dict[str, float]:
        x, y = batch
        return {"loss": float(((x @ self.w - y) ** 2).mean())}

    def state_dict(self) -> dict[str, Any]:
        return {"w": self.w.copy()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.w = np.array(state["w"], dtype=float)


def tiny_data(examples: int = 32, batch_size: int = 8, seed: int = 0) -> dict[str, BatchStream]:
    """A train stream and a ``valid`` stream for :class:`TinyModel`."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(examples, 3))
    y = x @ np.array([1.0, -2.0, 0.5])
    return {
        "train": BatchStream(x, y, batch_size=batch_size, seed=seed),
        "valid": BatchStream(x[: batch_size * 2], y[: batch_size * 2], batch_size=batch_size, shuffle=False),
    }
