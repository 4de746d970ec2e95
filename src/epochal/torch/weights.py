"""The full weights of a model, for a plugin, on one process, under DDP and under FSDP.

Under ``strategy = "fsdp"`` every rank holds a shard of each parameter (a ``DTensor``): reading
the whole of one (``param.full_tensor()``, ``model.state_dict()``, DCP's ``get_state_dict``) is
an all-gather, a **collective every rank must join**. A plugin that reads the weights on rank 0
alone (behind ``if loop.world.is_zero``, or with ``rank = "zero"``) waits forever for the other
ranks. :func:`full_weights` is the one call to make instead: every rank calls it at the same
point (from a hook every rank runs, at the same batch or epoch), rank 0 gets the weights, the
others ``None``::

    from epochal.torch import full_weights

    class ExportWeights:
        rank = "all"  # every rank runs it: the gather needs them all

        @hookimpl
        def after_epoch(self, loop):
            weights = full_weights(loop.model)  # a collective under FSDP
            if weights is not None:  # rank 0
                safetensors.torch.save_file(weights, f"weights-{loop.epoch}.safetensors")
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["full_weights"]


def full_weights(model: Any) -> dict[str, torch.Tensor] | None:
    """The full weights of *model* on rank 0 (name → CPU tensor), ``None`` on the other ranks.

    :param model: a :class:`~epochal.torch.TorchModel` (``loop.model``; several modules come
        under their names, ``"generator.0.weight"``) or a ``torch.nn.Module``.

    Under FSDP a collective: **call it on every rank**, at the same point (rank 0 alone would
    wait forever). The tensors are gathered to rank 0's host (``full_state_dict=True,
    cpu_offload=True``), so rank 0 needs the whole state in host memory; the other ranks get
    nothing. Unsharded (one process, DDP) it takes no collective and reads the module's own
    ``state_dict()`` (copied to the host), on rank 0 too. The names are the module's own (no
    DDP ``module.`` prefix, no ``torch.compile`` ``_orig_mod.``).

    :raises TypeError: *model* is neither a TorchModel nor a module.
    """
    module = _module_of(model)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    if _sharded(module):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        gathered = get_model_state_dict(module, options=options)  # every rank joins the gathers
        return (
            {name: tensor for name, tensor in gathered.items() if isinstance(tensor, torch.Tensor)}
            if rank == 0
            else None
        )
    if rank != 0:
        return None
    return {name: value.detach().to("cpu", copy=True) for name, value in module.state_dict().items()}


def _module_of(model: Any) -> torch.nn.Module:
    """The unwrapped module of a TorchModel (a ``ModuleDict`` of several), or *model* itself."""
    found = model if isinstance(model, torch.nn.Module) else getattr(model, "raw_module", None)
    if not isinstance(found, torch.nn.Module):
        kind = type(model).__name__
        raise TypeError(f"full_weights needs an epochal.torch.TorchModel or a torch.nn.Module, not {kind}")
    module: torch.nn.Module = found
    while True:  # DDP's and torch.compile's wrappers hold the module under their own names
        inner = getattr(module, "module", None) if _is_ddp(module) else getattr(module, "_orig_mod", None)
        if not isinstance(inner, torch.nn.Module):
            return module
        module = inner


def _is_ddp(module: torch.nn.Module) -> bool:
    return isinstance(module, torch.nn.parallel.DistributedDataParallel)


def _sharded(module: torch.nn.Module) -> bool:
    """Whether any parameter of *module* is a DTensor (FSDP2's shards)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in module.parameters())
