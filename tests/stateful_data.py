"""Streams that resume from their own state, for ``test_stateful_data.py`` (copied beside each
config, imported by the runs' processes).

:func:`write_files` writes jsonl files of ``{"x": [3 floats], "y": float}`` rows; :func:`make_data`
streams them with Hugging Face ``datasets`` (``streaming=True``, no download) as a dataset, a
torchdata ``StatefulDataLoader`` (with or without workers), a plain torch ``DataLoader``, or a
``StatefulDataLoader`` over a map-style dataset (shuffled; on several processes with a
``StatefulDistributedSampler``). :class:`Model` is a linear regression whose gradients are
averaged across the ranks and which draws from torch's global generator at every step, so that a
resumed run equals the straight one only if it saw the same batches and the same random numbers.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from epochal import hookimpl
from epochal.distributed import current_world

ROWS = 16


def write_files(directory: Path, files: int = 4, rows: int = ROWS, seed: int = 0) -> None:
    """*files* files ``part-NN.jsonl`` of *rows* rows each in *directory*."""
    rng = np.random.default_rng(seed)
    directory.mkdir(parents=True, exist_ok=True)
    for f in range(files):
        x = rng.normal(size=(rows, 3))
        y = x @ np.array([1.0, -2.0, 0.5]) + 0.1 * rng.normal(size=rows)
        lines = [json.dumps({"x": xi.tolist(), "y": float(yi)}) for xi, yi in zip(x, y)]
        (directory / f"part-{f:02d}.jsonl").write_text("\n".join(lines) + "\n")


def streaming(directory: str, files: int | None = None) -> Any:
    """The files of *directory* as a Hugging Face streaming dataset (one shard per file)."""
    from datasets import load_dataset

    paths = sorted(str(p) for p in Path(directory).glob("part-*.jsonl"))[:files]
    return load_dataset("json", data_files=paths, split="train", streaming=True)


def pairs(rows: list[dict[str, Any]]) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of rows as ``(x, y)`` tensors (module level: the workers unpickle it)."""
    x = torch.tensor([row["x"] for row in rows], dtype=torch.float64)
    y = torch.tensor([row["y"] for row in rows], dtype=torch.float64)
    return x, y


def make_data(
    directory: str,
    kind: str = "loader",
    workers: int = 0,
    files: int | None = None,
    batch_size: int = 4,
) -> dict[str, Any]:
    """The train stream of *kind*: ``dataset`` (batched), ``loader`` (StatefulDataLoader),
    ``dataloader`` (torch DataLoader) over the streamed files, or ``map`` (StatefulDataLoader
    over the rows in memory, shuffled)."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    if kind == "map":
        rows = list(streaming(directory, files))
        world = current_world()
        if world.size > 1:
            from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

            sampler = StatefulDistributedSampler(rows, num_replicas=world.size, rank=world.rank, seed=0)
            loader = StatefulDataLoader(
                rows, batch_size, sampler=sampler, collate_fn=pairs, num_workers=workers
            )
        else:
            loader = StatefulDataLoader(rows, batch_size, shuffle=True, collate_fn=pairs, num_workers=workers)
        return {"train": loader}
    dataset = streaming(directory, files)
    if kind == "dataset":
        return {"train": dataset.batch(batch_size)}
    if kind == "dataloader":
        return {"train": torch.utils.data.DataLoader(dataset, batch_size, collate_fn=pairs)}
    return {"train": StatefulDataLoader(dataset, batch_size, collate_fn=pairs, num_workers=workers)}


class Model:
    """Linear regression by SGD, gradients averaged across the ranks, plus noise from torch's
    global generator (a shifted generator changes the weights)."""

    def __init__(self, lr: float = 0.05) -> None:
        self.w = np.zeros(3)
        self.lr = lr
        self.world = current_world()
        #: the targets seen, in order: how many, and their sum weighted by their place
        self.seen = np.zeros(2)

    def distribute(self, world: Any) -> None:
        self.world = world

    def train_step(self, batch: Any) -> dict[str, float]:
        if isinstance(batch, dict):  # a batched Hugging Face dataset: lists
            x, y = np.asarray(batch["x"], dtype=float), np.asarray(batch["y"], dtype=float)
        else:
            x, y = (np.asarray(t, dtype=float) for t in batch)
        error = x @ self.w - y
        noise = torch.rand(3, dtype=torch.float64).numpy() * 1e-6
        grad = x.T @ error / len(x) + noise
        grad = self.world.all_reduce_arrays([grad])[0] / self.world.size
        self.w = self.w - self.lr * grad
        for value in y:
            self.seen += [1.0, (self.seen[0] + 1) * value]
        return {"loss": float((error**2).mean())}

    def eval_step(self, batch: Any) -> dict[str, float]:
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {"w": self.w.copy(), "seen": self.seen.copy()}

    def load_state_dict(self, state: Any) -> None:
        self.w = np.array(state["w"], dtype=float)
        self.seen = np.array(state["seen"], dtype=float)


def make_model(lr: float = 0.05) -> Model:
    return Model(lr)


class KillAt:
    """kill -9 of this process after batch *batch* of a fresh run (a resumed run goes on)."""

    def __init__(self, batch: int = 0) -> None:
        self.batch = batch

    @hookimpl(trylast=True)
    def after_batch(self, loop: Any) -> None:
        if not loop.resumed and loop.iteration == self.batch:
            os.kill(os.getpid(), 9)


class Record:
    """Writes the final weights and every target seen (rank 0), ``record.json``."""

    @hookimpl(trylast=True)
    def after_training(self, loop: Any) -> None:
        if loop.world.is_zero:
            state = loop.model.state_dict()
            record = {"w": state["w"].tolist(), "seen": state["seen"].tolist(), "iteration": loop.iteration}
            Path("record.json").write_text(json.dumps(record))


def write_config(directory: Path, data: str, *, epochs: int = 2, plugins: str = "") -> Path:
    """*directory*/run.toml: :class:`Model` on the files of *directory*/files, the ``[data]``
    table's extra lines *data*, the checkpoint plugin saving every batch and :class:`Record`;
    *plugins*: more plugins (names, then their tables)."""
    import shutil

    shutil.copy(Path(__file__), directory / "stateful_data.py")
    names, _, tables = plugins.partition("\n")
    config = directory / "run.toml"
    config.write_text(
        f"""[loop]
max_epochs = {epochs}
seed = 0
run_dir = "run"

[distributed]
backend = "gloo"
timeout = 60

[model]
factory = "stateful_data:make_model"

[data]
factory = "stateful_data:make_data"
directory = "{directory / "files"}"
{data}

[plugins]
autoload = false
order = ["checkpoint", "record"{names}]

[plugins.checkpoint]
every_n_batches = 1
keep_last = 2

[plugins.record]
factory = "stateful_data:Record"
{tables}
""",
        encoding="utf-8",
    )
    return config
