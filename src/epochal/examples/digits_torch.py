"""Handwritten digits with a small PyTorch CNN: the example of a ``TorchModel`` run.

The same data as :mod:`epochal.examples.digits` (scikit-learn's 8x8 digits, no download), as
numpy streams or as ``torch.utils.data.DataLoader``\\ s, and a two-convolution network. Every
``TorchModel`` option is a ``[model]`` key, so a TOML file (``examples/digits_torch.toml``)
chooses the device, precision, accumulation, clipping, optimizer, compilation and, on several
processes, DDP or FSDP (``strategy``)::

    [model]
    factory = "epochal.examples.digits_torch:make_model"
    optimizer = "adamw"
    precision = "bf16-mixed"
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset

from epochal.data import BatchStream
from epochal.errors import ConfigError, did_you_mean
from epochal.examples.digits import load_arrays
from epochal.torch import TorchModel

__all__ = ["OPTIMIZERS", "DigitsCNN", "accuracy", "make_data", "make_model"]

OPTIMIZERS = ("adam", "adamw", "sgd", "adadelta", "groups")


class DigitsCNN(torch.nn.Module):
    """Two 3x3 convolutions, a 2x2 max-pool and a linear classifier, for 1x8x8 images."""

    def __init__(self, channels: int = 16, dropout: float = 0.1) -> None:
        super().__init__()
        self.features = torch.nn.Sequential(
            torch.nn.Conv2d(1, channels, 3, padding=1),
            torch.nn.ReLU(),
            torch.nn.Conv2d(channels, 2 * channels, 3, padding=1),
            torch.nn.ReLU(),
            torch.nn.MaxPool2d(2),
        )
        self.classifier = torch.nn.Sequential(
            torch.nn.Flatten(), torch.nn.Dropout(dropout), torch.nn.Linear(2 * channels * 16, 10)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Class scores for a batch of flat 64-pixel images or 1x8x8 images."""
        return self.classifier(self.features(x.reshape(-1, 1, 8, 8)))


def accuracy(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The share of correct predictions, as a 0-d tensor (read only when someone asks)."""
    return (outputs.argmax(dim=1) == targets).float().mean()


def _optimizer(name: str, module: DigitsCNN, lr: float | None) -> torch.optim.Optimizer:
    if name == "adam":
        return torch.optim.Adam(module.parameters(), lr=lr or 3e-3)
    if name == "adamw":
        return torch.optim.AdamW(module.parameters(), lr=lr or 3e-3, weight_decay=1e-2)
    if name == "sgd":
        return torch.optim.SGD(module.parameters(), lr=lr or 0.05, momentum=0.9, nesterov=True)
    if name == "adadelta":
        return torch.optim.Adadelta(module.parameters(), lr=lr or 1.0)
    if name == "groups":  # two parameter groups with their own hyperparameters
        return torch.optim.AdamW(
            [
                {"params": module.features.parameters(), "lr": lr or 3e-3, "weight_decay": 0.0},
                {"params": module.classifier.parameters(), "lr": (lr or 3e-3) / 3, "weight_decay": 1e-2},
            ]
        )
    raise ConfigError(
        f"[model] optimizer {name!r} is not one of {', '.join(OPTIMIZERS)}{did_you_mean(name, OPTIMIZERS)}"
    )


def make_model(
    channels: int = 16,
    optimizer: str = "adam",
    lr: float | None = None,
    seed: int = 0,
    device: str = "auto",
    precision: Literal["32-true", "16-mixed", "bf16-mixed", "bf16-true"] = "32-true",
    accumulate_grad_batches: int = 1,
    gradient_clip_val: float | None = None,
    gradient_clip_algorithm: Literal["norm", "value"] = "norm",
    compile: bool | str = False,
    stream_metrics: bool = False,
    train_stream_metrics: bool = False,
    ddp_options: dict[str, Any] | None = None,
    strategy: Literal["ddp", "fsdp"] = "ddp",
) -> TorchModel:
    """A :class:`TorchModel` of :class:`DigitsCNN` with cross-entropy and accuracy.

    :param channels: the width of the first convolution (the second has twice as many).
    :param optimizer: ``adam``, ``adamw``, ``sgd`` (Nesterov momentum), ``adadelta`` or
        ``groups`` (AdamW with two parameter groups).
    :param lr: the learning rate (None: the optimizer's default for this example).
    :param seed: seeds the weight initialisation.
    :param compile: ``torch.compile`` the module (true), or with the backend named.
    :param stream_metrics: add a macro F1 score over each whole evaluation stream
        (torchmetrics).
    :param train_stream_metrics: compute that F1 over each training epoch too (``train.f1``).
    The other keys are :class:`TorchModel`'s.
    """
    torch.manual_seed(seed)
    module = DigitsCNN(channels)
    opt = _optimizer(optimizer, module, lr)
    net: Any = module
    if compile:
        net = torch.compile(module, backend=compile if isinstance(compile, str) else "inductor")
    metrics: dict[str, Any] = {"accuracy": accuracy}
    if stream_metrics:
        from torchmetrics.classification import MulticlassF1Score

        metrics["f1"] = MulticlassF1Score(num_classes=10, average="macro")
    return TorchModel(
        net,
        opt,
        torch.nn.functional.cross_entropy,
        metrics,
        device=device,
        precision=precision,
        accumulate_grad_batches=accumulate_grad_batches,
        gradient_clip_val=gradient_clip_val,
        gradient_clip_algorithm=gradient_clip_algorithm,
        ddp_options=ddp_options,
        strategy=strategy,
        train_stream_metrics=train_stream_metrics,
    )


def make_data(
    batch_size: int = 64,
    seed: int = 0,
    valid_fraction: float = 0.2,
    loader: bool = False,
    num_workers: int = 0,
) -> dict[str, Any]:
    """The ``"train"`` and ``"valid"`` streams of a seeded split of the digits.

    :param loader: return ``torch.utils.data.DataLoader``\\ s (shuffled train) instead of
        :class:`~epochal.data.BatchStream`\\ s; the loop makes them resumable.
    :param num_workers: the DataLoaders' worker processes.
    """
    if not 0.0 < valid_fraction < 1.0:
        raise ConfigError(f"[data] valid_fraction must be in (0, 1), not {valid_fraction!r}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(f"[data] batch_size must be a positive integer, not {batch_size!r}")
    x, y = load_arrays()
    order = np.random.default_rng(seed).permutation(len(x))
    n_valid = round(len(x) * valid_fraction)
    valid, train = np.sort(order[:n_valid]), np.sort(order[n_valid:])
    if not loader:
        return {
            "train": BatchStream(x[train], y[train], batch_size=batch_size, shuffle=True, seed=seed),
            "valid": BatchStream(x[valid], y[valid], batch_size=batch_size, shuffle=False, seed=seed),
        }
    options: dict[str, Any] = {"batch_size": batch_size, "num_workers": num_workers}
    if num_workers:
        options["persistent_workers"] = True
    train_set = TensorDataset(torch.from_numpy(x[train]), torch.from_numpy(y[train]))
    valid_set = TensorDataset(torch.from_numpy(x[valid]), torch.from_numpy(y[valid]))
    return {
        "train": DataLoader(train_set, shuffle=True, **options),
        "valid": DataLoader(valid_set, shuffle=False, **options),
    }
