"""The sharded side of the fuzz campaign (:mod:`epochal_checkpoint.fuzz`): a pristine directory
of sharded checkpoints (DCP's ``.metadata`` and ``.distcp`` beside ``data.bin``) and the load
a resume does after reading one (every DCP read: ``.metadata`` and each record, as a
``TorchModel`` loads them).

A sharded case passes as any other (a load of the newest, or a fallback to the older one with
one warning) or ends in a one-line error of the model's load (``DamagedShardsError``: damage
that only reading the tensors shows, their checksums made to agree): counted apart, never a
raw exception. No payload may run (the ``pickle-payload`` kind plants ``os.system``,
``eval``, ``getattr`` chains, torch globals; :func:`epochal_checkpoint.forgery.executed`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["load_model", "make_model", "make_sharded_pristine"]


def make_model() -> Any:
    """A small ``TorchModel`` (a two-layer MLP with AdamW) on the CPU."""
    import torch

    from epochal.torch import TorchModel

    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(module.parameters(), lr=0.01)
    return TorchModel(module, optimizer, torch.nn.functional.mse_loss, device="cpu")


def _data() -> dict[str, Any]:
    import numpy as np

    from epochal.data import BatchStream

    x = np.random.default_rng(0).standard_normal((128, 8), dtype=np.float32)
    return {"train": BatchStream(x, x[:, :1].copy(), batch_size=16, seed=0)}


def make_sharded_pristine(directory: Path, key: str | None = None) -> Path:
    """Two sharded checkpoints (one process, DCP files, log segments) of a small ``TorchModel``
    run in *directory*; signed with *key* if given."""
    from epochal_checkpoint.fuzz import run_pristine

    run_pristine(directory, make_model(), _data(), key, format="sharded")
    return directory


def load_model(model: Any, state: dict[str, Any]) -> None:
    """Load a checkpoint's model state as a resume does (a sharded one: every DCP read)."""
    model.load_state_dict(state["model"])
