"""One line that says what a :class:`~epochal.torch.TorchModel` trains (Lightning's model summary).

Printed by ``epochal run`` when training starts: the module's class, its parameters (all and
trainable, counted once when shared), their size in memory, the precision and the device, and
how it is distributed. Lightning prints a table of layers; a line keeps the console readable
at 80 columns, and ``print(model.module)`` shows the layers.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["describe", "human"]


def human(count: float, unit: str = "") -> str:
    """``1234567`` as ``1.2 M`` (``K``, ``M``, ``B``; bytes with *unit* ``"B"``: ``KB``, ``MB``, ``GB``)."""
    for size, prefix in ((1e9, "G" if unit else "B"), (1e6, "M"), (1e3, "K")):
        if count >= size:
            return f"{count / size:.3g} {prefix}{unit}"
    return f"{count:.0f} {unit}".rstrip()


def describe(model: Any) -> str:
    """``DigitsCNN: 12.3 K parameters (12.3 K trainable), 49.3 KB, 32-true on cpu``."""
    module: torch.nn.Module = model.raw_module
    params = list(module.parameters())  # each shared parameter once
    total = sum(p.numel() for p in params)
    trainable = sum(p.numel() for p in params if p.requires_grad)
    size = sum(p.numel() * p.element_size() for p in params)
    size += sum(b.numel() * b.element_size() for b in module.buffers())
    world = getattr(model, "world", None)
    parts = model.parts
    # fully_shard swaps a class for FSDP<name>
    names = {n: type(m).__name__.removeprefix("FSDP") for n, m in parts.raw.items()}
    name = " + ".join(f"{n} ({c})" for n, c in names.items()) if parts.several_modules else names.popitem()[1]
    wrapped_by: str | None
    if getattr(model, "sharded", False):
        wrapped_by = "FSDP2"
    else:
        wrapped_by = "DistributedDataParallel" if parts.ddp else None
    where = f", {wrapped_by} over {world.size} processes" if world is not None and wrapped_by else ""
    return (
        f"{name}: {human(total)} parameters ({human(trainable)} trainable), "
        f"{human(size, 'B')}, {model.precision.name} on {model.device}{where}"
    )
