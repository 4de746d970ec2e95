"""Devices and precision for :class:`~epochal.torch.TorchModel`: names users know, checked early.

``device``: ``"auto"`` (cuda if available, else mps, else cpu), ``"cpu"``, ``"cuda"``,
``"cuda:N"``, ``"mps"``. ``precision`` uses Lightning's names: ``"32-true"``, ``"16-mixed"``
(float16 autocast with a gradient scaler), ``"bf16-mixed"`` (bfloat16 autocast), ``"bf16-true"``
(bfloat16 parameters and inputs).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from epochal.errors import ConfigError, did_you_mean

__all__ = ["PRECISIONS", "Precision", "move_to", "resolve_device"]

PRECISIONS = ("32-true", "16-mixed", "bf16-mixed", "bf16-true")
_DEVICE_TYPES = ("auto", "cpu", "cuda", "mps")
#: other spellings users write, and the name they most likely mean.
_ALIASES = {"16": "16-mixed", "fp16": "16-mixed", "bf16": "bf16-mixed", "32": "32-true", "fp32": "32-true"}


def resolve_device(spec: str | torch.device) -> torch.device:
    """The device *spec* names, checked against this machine.

    :raises ConfigError: an unknown name, or a device this machine does not have.
    """
    if isinstance(spec, torch.device):
        spec = str(spec)
    if not isinstance(spec, str):
        raise ConfigError(f"TorchModel device must be a string such as 'auto' or 'cuda:0', not {spec!r}")
    if spec == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        mps = getattr(torch.backends, "mps", None)
        if mps is not None and mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    kind, _, index = spec.partition(":")
    if kind not in _DEVICE_TYPES or (index and not index.isdigit()):
        raise ConfigError(
            f"TorchModel device {spec!r} is not one of 'auto', 'cpu', 'cuda', 'cuda:N', 'mps'"
            f"{did_you_mean(kind, _DEVICE_TYPES)}"
        )
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(
                f"TorchModel device {spec!r}: CUDA is not available on this machine "
                f"(torch {torch.__version__}, built {'with' if torch.version.cuda else 'without'} CUDA); "
                "use device = 'auto' or 'cpu'"
            )
        count = torch.cuda.device_count()
        if index and int(index) >= count:
            raise ConfigError(f"TorchModel device {spec!r}: this machine has {count} CUDA device(s)")
        return torch.device("cuda", int(index) if index else torch.cuda.current_device())
    if kind == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise ConfigError(f"TorchModel device {spec!r}: MPS is not available on this machine")
    return torch.device(spec)


def move_to(batch: Any, device: torch.device, dtype: torch.dtype | None = None) -> Any:
    """*batch* with every array and tensor on *device* (tuples, lists and dicts kept).

    Numpy arrays become tensors without a copy on the host; copies to a CUDA device are
    ``non_blocking`` (asynchronous from pinned memory, e.g. a DataLoader's ``pin_memory``).
    With *dtype*, floating-point tensors are cast to it (``bf16-true``).
    """
    if isinstance(batch, torch.Tensor):
        tensor = batch
    elif isinstance(batch, np.ndarray):
        tensor = (
            torch.from_numpy(batch)
            if batch.dtype.isnative
            else torch.from_numpy(batch.astype(batch.dtype.newbyteorder("=")))
        )
    elif isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
        return type(batch)(*(move_to(v, device, dtype) for v in batch))
    elif isinstance(batch, (tuple, list)):
        moved = [move_to(v, device, dtype) for v in batch]
        if all(a is b for a, b in zip(moved, batch)):
            return batch  # already where it belongs (the common case of batches made on the device)
        return type(batch)(moved)
    elif isinstance(batch, Mapping):
        return {k: move_to(v, device, dtype) for k, v in batch.items()}
    else:
        return batch
    if dtype is not None and tensor.is_floating_point():
        tensor = tensor.to(dtype)
    if tensor.device != device:
        tensor = tensor.to(device, non_blocking=device.type == "cuda")
    return tensor


class Precision:
    """What a precision name means: autocast, a gradient scaler, the parameters' dtype.

    :raises ConfigError: an unknown name, or a combination this device cannot run.
    """

    def __init__(self, name: str, device: torch.device) -> None:
        if name not in PRECISIONS:
            alias = _ALIASES.get(str(name).lower())
            hint = f" (did you mean {alias!r}?)" if alias else did_you_mean(str(name), PRECISIONS)
            raise ConfigError(f"TorchModel precision {name!r} is not one of {', '.join(PRECISIONS)}{hint}")
        self.name = name
        self.device = device
        #: the dtype of parameters and floating inputs (None: leave them as they are).
        self.param_dtype: torch.dtype | None = torch.bfloat16 if name == "bf16-true" else None
        self._autocast_dtype = {"16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}.get(name)
        if self._autocast_dtype is not None and not torch.amp.is_autocast_available(device.type):
            raise ConfigError(f"TorchModel precision {name!r}: autocast is not available on {device}")
        #: the gradient scaler of 16-mixed (None otherwise).
        self.scaler: torch.amp.GradScaler | None = (
            torch.amp.GradScaler(device.type) if name == "16-mixed" else None
        )

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """A context in which the forward pass and the loss run."""
        if self._autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self._autocast_dtype)

    def backward(self, loss: torch.Tensor) -> None:
        """Back-propagate *loss* (scaled under 16-mixed)."""
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
        else:
            loss.backward()

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Make the gradients true gradients before hooks read them and clipping."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """Step *optimizer* (through the scaler under 16-mixed, which skips non-finite steps).

        Under 16-mixed, :meth:`update` follows once the batch's optimizers have all stepped
        (torch's rule for several optimizers: one ``scaler.update()`` per iteration).
        """
        if self.scaler is not None:
            self.scaler.step(optimizer)
        else:
            optimizer.step()

    def update(self) -> None:
        """Update the scale (16-mixed) after the optimizer steps of one batch."""
        if self.scaler is not None:
            self.scaler.update()

    def backward_outside_autocast(self, loss: torch.Tensor) -> None:
        """:meth:`backward` called from inside :meth:`autocast` (a step that owns its
        optimization): autocast is left off for the backward pass, as torch advises."""
        if self._autocast_dtype is None:
            self.backward(loss)
            return
        with torch.autocast(self.device.type, enabled=False):
            self.backward(loss)
