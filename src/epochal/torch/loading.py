"""Loading a checked :class:`~epochal.torch.TorchModel` state into a module's live tensors.

A state just read from a checkpoint holds writable numpy arrays; on CPU they become the memory
of the module's parameters and buffers, with no copy (issue 32). Only a module whose
``load_state_dict`` does no more than copy each value may be loaded that way: hooks and custom
``_load_from_state_dict`` methods get their values through ``load_state_dict`` as usual.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from epochal.torch.state import from_plain, in_place, is_tensor_record, reading_tensor, shareable

__all__ = ["load_module", "loads_plainly"]

# What a module may define as its _load_from_state_dict for its parameters and buffers to be
# loaded by taking the saved arrays' memory: these only copy (_NormBase adds a missing
# num_batches_tracked first; the state of a TorchModel always has it).
_PLAIN_LOADERS = (
    torch.nn.Module._load_from_state_dict,
    torch.nn.modules.batchnorm._NormBase._load_from_state_dict,
)


def loads_plainly(module: torch.nn.Module) -> bool:
    """Whether ``module.load_state_dict`` does no more than copy each value into its tensor."""
    return all(
        not m._load_state_dict_pre_hooks
        and not m._load_state_dict_post_hooks
        and type(m)._load_from_state_dict in _PLAIN_LOADERS
        for m in module.modules()
    )


def load_module(module: torch.nn.Module, saved: Mapping[str, Any], *, may_share: bool) -> None:
    """Load *saved* (checked) into *module*: its CPU parameters and buffers take the arrays'
    memory where they can (``tensor.data = ...``, as ``module.to()`` does: the optimizer's
    references stay valid); the rest is copied into the tensors by ``load_state_dict``,
    from tensors that read the arrays in place (one copy, the transfer to the device).

    :param may_share: whether the tensors may take the arrays' memory at all (TorchModel passes
        False while its module is wrapped in DDP).
    """
    live = module.state_dict(keep_vars=True)
    owned: set[int] = set()
    if may_share and loads_plainly(module):
        owned = {id(t) for _, t in module.named_parameters(remove_duplicate=False)}
        owned |= {id(t) for _, t in module.named_buffers(remove_duplicate=False)}
    rest: dict[str, Any] = {}
    with torch.no_grad():
        for key, value in saved.items():
            target = live[key]
            array = isinstance(value, np.ndarray) or is_tensor_record(value)
            if isinstance(target, torch.Tensor) and in_place(value, target):
                continue  # read into this tensor already (load_destinations)
            if (
                id(target) in owned
                and type(target) in (torch.Tensor, torch.nn.Parameter)  # no DTensor, no subclass
                and target.device.type == "cpu"
                and target.is_contiguous()  # its layout stays (a transposed or channels_last one)
                and shareable(value)
            ):
                target.data = from_plain(value, target, share=True)
            elif array and isinstance(target, torch.Tensor):
                rest[key] = reading_tensor(value)
            else:
                rest[key] = from_plain(value, target)
    if rest:
        # the keys were checked; those taken above are missing from rest
        module.load_state_dict(rest, strict=len(rest) == len(saved))
