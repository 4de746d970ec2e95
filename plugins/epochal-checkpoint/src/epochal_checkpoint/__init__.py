"""epochal-checkpoint: atomic, pickle-free checkpoints and exact resume for epochal.

Two plugins (entry points of ``epochal.plugins``): ``checkpoint`` (:class:`Checkpoint`) saves
the loop's state on triggers and resumes a run from its newest complete checkpoint
(``epochal run CONFIG --resume``); ``load`` (:class:`Load`) starts a run from a given
checkpoint, fully or the model's arrays only. Reading checkpoints from Python::

    from epochal_checkpoint import load_latest, read_checkpoint

    state, info = load_latest(Path("runs/digits/checkpoints"))
    state["model"]["W1"]  # a numpy array
"""

from __future__ import annotations

from typing import Any

from epochal_checkpoint.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointWriteError,
    CorruptCheckpointError,
    ForeignCheckpointError,
    StateMismatchError,
    UnsafeCheckpointError,
    UnsignedCheckpointError,
    UnsupportedStateError,
)

_LAZY = {
    "Checkpoint": "epochal_checkpoint.plugin",
    "Load": "epochal_checkpoint.plugin",
    "read_checkpoint": "epochal_checkpoint.storage.load",
    "load_latest": "epochal_checkpoint.storage.load",
    "list_checkpoints": "epochal_checkpoint.storage.layout",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'epochal_checkpoint' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


__all__ = [
    "Checkpoint",
    "CheckpointError",
    "CheckpointNotFoundError",
    "CheckpointWriteError",
    "CorruptCheckpointError",
    "ForeignCheckpointError",
    "Load",
    "StateMismatchError",
    "UnsafeCheckpointError",
    "UnsignedCheckpointError",
    "UnsupportedStateError",
    "list_checkpoints",
    "load_latest",
    "read_checkpoint",
]
