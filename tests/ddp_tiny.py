"""A tiny data-parallel regression for the multi-process tests (copied beside each test's config).

The gradient is averaged over the ranks with ``World.all_reduce_arrays`` (what DDP does for a
torch module) once the loop called ``distribute(world)``; the loop gives each rank its own shard
of the train and evaluation streams, so the reduced evaluation metrics are the whole stream's.
:func:`write_config` writes a run of it (the tests' and ``bench/shutdown_abort.py``'s).
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from epochal import hookimpl
from epochal.data import BatchStream
from epochal.distributed import current_world


class Model:
    """Linear regression by SGD with gradients averaged across the ranks."""

    def __init__(self, lr: float = 0.1, seed: int = 0, delay: float = 0.0) -> None:
        self.w = np.random.default_rng(seed).normal(size=3)
        self.lr = lr
        self.delay = delay
        self.world = current_world()

    def distribute(self, world: Any) -> None:
        self.world = world

    def train_step(self, batch: Any) -> dict[str, float]:
        x, y = batch
        if self.delay:
            time.sleep(self.delay)
        error = x @ self.w - y
        # numpy's global RNG is part of each rank's state: every rank draws a different number
        # of values from it, so that resuming must restore each rank's own generator (the noise
        # is averaged with the gradients: the ranks' models stay equal, as DDP keeps them)
        noise = np.random.normal(scale=1e-6, size=3 + self.world.rank)[:3]
        grad = x.T @ error / len(x) + noise
        grad = self.world.all_reduce_arrays([grad])[0] / self.world.size
        self.w = self.w - self.lr * grad
        return {"loss": float((error**2).mean())}

    def eval_step(self, batch: Any) -> dict[str, float]:
        x, y = batch
        return {"loss": float(((x @ self.w - y) ** 2).mean()), "mae": float(np.abs(x @ self.w - y).mean())}

    def state_dict(self) -> dict[str, Any]:
        return {"w": self.w.copy()}

    def load_state_dict(self, state: Any) -> None:
        self.w = np.array(state["w"], dtype=float)


def make_model(lr: float = 0.1, seed: int = 0, delay: float = 0.0) -> Model:
    return Model(lr, seed, delay)


def make_data(examples: int = 64, batch_size: int = 4, seed: int = 0, valid: int = 30) -> dict[str, Any]:
    """8 batches per rank and epoch on 2 processes (16 on one); a valid stream of *valid* examples."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(examples, 3))
    y = x @ np.array([1.0, -2.0, 0.5]) + 0.1 * rng.normal(size=examples)
    return {
        "train": BatchStream(x, y, batch_size=batch_size, seed=seed),
        "valid": BatchStream(x[:valid], y[:valid], batch_size=4, shuffle=False),
    }


class StopOnRank:
    """Asks for a stop on one rank only: after batch *batch*, or after epoch *epoch*."""

    def __init__(self, rank: int = 1, batch: int = 0, epoch: int = 0) -> None:
        self.rank, self.batch, self.epoch = rank, batch, epoch

    @hookimpl
    def after_batch(self, loop: Any) -> None:
        if loop.world.rank == self.rank and loop.iteration == self.batch:
            loop.request_stop(f"stop-on-rank after batch {self.batch}")

    @hookimpl
    def after_epoch(self, loop: Any) -> None:
        if loop.world.rank == self.rank and loop.epoch == self.epoch:
            loop.request_stop(f"stop-on-rank after epoch {self.epoch}")


class RunDir:
    """Writes, per rank, the directory the run writes into (the ranks must agree on it)."""

    @hookimpl
    def before_training(self, loop: Any) -> None:
        with open(f"run-dir-{loop.world.rank}.txt", "w", encoding="utf-8") as out:
            out.write(f"{loop.run_dir}\n")


class Where:
    """Writes, per rank, where the run ended (for the tests to compare the ranks)."""

    def __init__(self, path: str = "where") -> None:
        self.path = path

    @hookimpl(trylast=True)
    def after_training(self, loop: Any) -> None:
        with open(f"{self.path}-{loop.world.rank}.txt", "w", encoding="utf-8") as out:
            out.write(f"{loop.epoch} {loop.iteration} {loop.log.status['finish_reason']}\n")


def write_config(
    directory: Path,
    plugins: Sequence[str],
    *,
    max_epochs: int = 3,
    data: str = "",
    tables: str = "",
    probe: bool = True,
    extra: str = "",
    helpers: Sequence[str] = (),
) -> Path:
    """*directory*/run.toml: this module's model and data on gloo (this module, and the *helpers*
    beside it, copied into *directory*), *plugins* in that order and nothing autoloaded; *data*:
    more lines of the ``[data]`` table; *tables* (TOML tables) next; with *probe*, the
    :class:`Where` probe plugin's table; *extra* appended last."""
    here = Path(__file__).resolve().parent
    for helper in ("ddp_tiny.py", *helpers):
        shutil.copy(here / helper, directory / helper)
    where = '[plugins.where]\nfactory = "ddp_tiny:Where"\n' if probe else ""
    config = directory / "run.toml"
    config.write_text(
        f"""[loop]
max_epochs = {max_epochs}
seed = 0
run_dir = "run"

[distributed]
backend = "gloo"
timeout = 60

[model]
factory = "ddp_tiny:make_model"

[data]
factory = "ddp_tiny:make_data"
{data}
[plugins]
order = {list(plugins)!r}
autoload = false
{tables}
{where}"""
        + extra,
        encoding="utf-8",
    )
    return config
