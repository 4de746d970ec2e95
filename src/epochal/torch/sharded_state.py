"""A TorchModel's tensors as torch.distributed.checkpoint (DCP) sees them: sharded, never gathered.

:func:`sharded_state` gives ``{"model": ..., "optim": ...}`` from DCP's
``get_state_dict(module, optimizer)``: each rank's own tensors (an FSDP2 module's DTensor
shards, a DDP module's full replicated tensors, which DCP writes once), never gathered to one
rank. :func:`load_sharded_state` puts such a state back with ``set_state_dict``, and
:func:`load_from` reads it from a DCP checkpoint directory first (every rank calls it: a
collective under a process group; on one process without one, DCP reads and reshards alone).

The model's small rest (accumulation counters, grad scaler) stays in the plain state that the
checkpoint plugin writes in its own format.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

__all__ = ["load_from", "load_sharded_state", "sharded_state"]

#: one optimizer, or the several of a model (DCP merges their states, keyed by parameter names).
Optimizers = torch.optim.Optimizer | Sequence[torch.optim.Optimizer]


def _options(full: bool = False) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # a DDP module's tensors are full on every rank: DCP deduplicates them when it saves
    return StateDictOptions(full_state_dict=full, cpu_offload=False)


def sharded_state(module: torch.nn.Module, optimizer: Optimizers) -> dict[str, Any]:
    """``{"model": ..., "optim": ...}``: the tensors (or DTensor shards) of *module* and
    *optimizer* (or several: one state over all of them) keyed by the parameters' fully
    qualified names, as views (no copy)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, optim = get_state_dict(module, optimizer, options=_options())
    return {"model": model, "optim": optim}


def load_sharded_state(module: torch.nn.Module, optimizer: Optimizers, state: Mapping[str, Any]) -> None:
    """Put *state* (from :func:`sharded_state`, as loaded by DCP) into *module* and *optimizer*."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    set_state_dict(
        module,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optim"],
        options=_options(),
    )


def load_from(
    module: torch.nn.Module,
    optimizer: Optimizers,
    path: str | Path,
    model_only: bool = False,
    storage_options: Mapping[str, Any] | None = None,
) -> None:
    """Read the DCP checkpoint in directory *path* into *module* and *optimizer* (resharded to
    this world by DCP); with *model_only*, into *module* only.

    *path* may be an fsspec URL (``s3://...``: each process reads what it needs from the store,
    through DCP's ``FsspecReader``, with *storage_options*): on several machines, where no
    local copy is on every one.

    :raises DamagedShardsError: one line naming *path*, when its files cannot be read (no
        code in them is ever run: :mod:`epochal.torch.dcp_io`).
    :raises ShardsMismatchError: one line naming *path*, when its tensors do not fit.
    """
    from epochal.torch import dcp_io

    state = sharded_state(module, optimizer)
    if model_only:
        del state["optim"]
    single = not (torch.distributed.is_available() and torch.distributed.is_initialized())
    # one error for what DCP raises (CheckpointException is a BaseException), no code read
    dcp_io.load(state, path, storage_options, no_dist=single)
    try:
        if model_only:
            from torch.distributed.checkpoint.state_dict import set_model_state_dict

            set_model_state_dict(module, state["model"], options=_options())
        else:
            load_sharded_state(module, optimizer, state)
    except Exception as error:
        why = f"{type(error).__name__}: {' '.join(str(error).split())}"
        raise dcp_io.ShardsMismatchError(
            f"the sharded checkpoint {str(path)!r} does not fit the model: {why:.500}"
        ) from error
