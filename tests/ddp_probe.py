"""Model, data and a recording plugin for the runs of ``test_torch_distributed.py`` (via torchrun).

Imported by the test processes (``PYTHONPATH`` names this directory) through the run
configuration's factories: ``ddp_probe:make_model``, ``ddp_probe:make_data`` and the local
plugin ``[plugins.probe] factory = "ddp_probe:Probe"``. Each rank writes what it saw and
holds to ``rank<R>.pkl`` in the probe's directory when training ends.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset

from epochal import hookimpl
from epochal.data import BatchStream
from epochal.torch import TorchModel

FEATURES, CLASSES = 6, 3


def arrays(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Distinct random rows (so a row identifies its example) and their classes."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, FEATURES)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64) + (x[:, 1] > 0.5).astype(np.int64)
    return x, y


def make_data(
    n_train: int = 64, n_valid: int = 21, batch_size: int = 8, loader: bool = True
) -> dict[str, Any]:
    """A shuffled train stream and an evaluation stream ``valid`` (DataLoaders or BatchStreams)."""
    xt, yt = arrays(n_train, 1)
    xv, yv = arrays(n_valid, 2)
    if not loader:
        return {
            "train": BatchStream(xt, yt, batch_size=batch_size, seed=0),
            "valid": BatchStream(xv, yv, batch_size=batch_size, shuffle=False),
        }
    return {
        "train": DataLoader(
            TensorDataset(torch.from_numpy(xt), torch.from_numpy(yt)), batch_size, shuffle=True
        ),
        "valid": DataLoader(TensorDataset(torch.from_numpy(xv), torch.from_numpy(yv)), batch_size),
    }


def accuracy(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return (outputs.argmax(dim=1) == targets).float().mean()


def make_model(
    seed: int = 0,
    lr: float = 0.5,
    accumulate_grad_batches: int = 1,
    compile: str = "",
    device: str = "cpu",
    plain_metric: bool = False,
    train_stream_metrics: bool = False,
) -> TorchModel:
    """An MLP trained by plain SGD, with a batch metric and a torchmetrics F1 over whole streams."""
    from torchmetrics.classification import MulticlassF1Score

    torch.manual_seed(seed)
    module = torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), torch.nn.Tanh(), torch.nn.Linear(16, CLASSES))
    optimizer = torch.optim.SGD(module.parameters(), lr=lr)
    net: Any = torch.compile(module, backend=compile) if compile else module
    metrics: dict[str, Any] = {
        "accuracy": accuracy,
        "f1": MulticlassF1Score(num_classes=CLASSES, average="macro"),
    }
    if plain_metric:
        metrics["count"] = Count()
    return TorchModel(
        net,
        optimizer,
        torch.nn.functional.cross_entropy,
        metrics,
        device=device,
        accumulate_grad_batches=accumulate_grad_batches,
        train_stream_metrics=train_stream_metrics,
    )


class Count:
    """A metric object of the user's own (update/compute/reset, no sync): examples seen."""

    def __init__(self) -> None:
        self.n = 0

    def update(self, outputs: Any, targets: Any) -> None:
        self.n += len(targets)

    def compute(self) -> int:
        return self.n

    def reset(self) -> None:
        self.n = 0


def as_numpy(value: Any) -> np.ndarray:
    return value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else np.asarray(value)


def params_of(model: Any) -> dict[str, np.ndarray]:
    state = model.state_dict()
    return {k: np.asarray(v) for k, v in state.get("module", state).items()}


def module_class(model: Any) -> str | None:
    """The class a training step calls (outside a step ``model.module`` is the module itself)."""
    parts = getattr(model, "parts", None)  # the numpy model has none
    return None if parts is None else type(parts.train_views["module"]).__name__


class Probe:
    """Records every training batch, the last evaluation's batches and the final parameters.

    :param dir: where ``rank<R>.pkl`` is written.
    :param load_from: a pickled model state loaded into the model before training.
    :param grab_mid_window: take ``model.state_dict()`` inside the first accumulation window.
    """

    def __init__(self, dir: str, load_from: str = "", grab_mid_window: bool = False) -> None:
        self.dir = Path(dir)
        self.load_from = load_from
        self.grab_mid_window = grab_mid_window
        self.train: list[tuple[np.ndarray, np.ndarray]] = []
        self.valid: list[tuple[np.ndarray, np.ndarray, dict[str, float]]] = []
        self.allreduces = 0
        self.mid_window: Any = None

    @hookimpl
    def before_training(self, loop: Any) -> None:
        model = loop.model
        if self.load_from:
            model.load_state_dict(pickle.loads(Path(self.load_from).read_bytes()))
        ddp = model.parts.ddp.get("module") if hasattr(model, "parts") else None
        if ddp is not None:
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

            def counting(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks annotations
                self.allreduces += 1
                return allreduce_hook(state, bucket)

            ddp.register_comm_hook(None, counting)

    @hookimpl
    def after_batch(self, loop: Any, batch: Any) -> None:
        self.train.append((as_numpy(batch[0]), as_numpy(batch[1])))
        if self.grab_mid_window and self.mid_window is None and getattr(loop.model, "accumulated", 0) == 1:
            self.mid_window = loop.model.state_dict()  # a collective: every rank is here

    @hookimpl
    def before_evaluation(self) -> None:
        self.valid = []

    @hookimpl
    def after_eval_batch(self, batch: Any, outputs: Any) -> None:
        values = {k: float(v) for k, v in outputs.items()}
        self.valid.append((as_numpy(batch[0]), as_numpy(batch[1]), values))

    @hookimpl
    def after_training(self, loop: Any) -> None:
        model = loop.model
        record = {
            "rank": loop.world.rank,
            "size": loop.world.size,
            "train": self.train,
            "valid": self.valid,
            "metrics": loop.last_metrics,
            "rows": {i: dict(row) for i, row in loop.log.rows()},
            "params": params_of(model),
            "state": model.state_dict(),
            "allreduces": self.allreduces,
            "optimizer_steps": getattr(model, "optimizer_steps", None),
            "mid_window": self.mid_window,
            # what a training step calls (outside a step model.module is the module itself)
            "module_class": module_class(model),
        }
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / f"rank{loop.world.rank}.pkl").write_bytes(pickle.dumps(record))
