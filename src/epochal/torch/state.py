"""Tensors as plain data: numpy arrays, numbers, strings, lists and dicts, never pickle.

A checkpoint of epochal holds numpy arrays and JSON values. Tensors of a dtype numpy has
(float16/32/64, complex64/128, bool, signed and unsigned integers) become a numpy copy of
themselves. Tensors of a dtype numpy lacks (bfloat16, the float8 and float4 variants, complex32)
become a *tagged record* ``{"__tensor__": "bfloat16", "bits": uint16 array}``: their raw bits
in an unsigned array of the same item size, and torch's name of the dtype. Both round-trip
bitwise, 0-d, empty and non-contiguous tensors included, and load onto any device.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

__all__ = ["TENSOR_TAG", "from_plain", "is_tensor_record", "plain_dtype_and_shape", "to_plain"]

#: The key that marks a tagged tensor record.
TENSOR_TAG = "__tensor__"
_BITS = {1: torch.uint8, 2: torch.uint16, 4: torch.int32, 8: torch.int64}


#: the torch dtypes numpy has an equal of (the others are saved as their bits).
_NUMPY_DTYPES = {
    torch.bool, torch.uint8, torch.uint16, torch.uint32, torch.uint64,
    torch.int8, torch.int16, torch.int32, torch.int64,
    torch.float16, torch.float32, torch.float64, torch.complex64, torch.complex128,
}  # fmt: skip


def tensor_to_plain(tensor: torch.Tensor) -> np.ndarray | dict[str, Any]:
    """A C-contiguous numpy copy of *tensor*, or a tagged record when numpy lacks its dtype."""
    tensor = tensor.detach()
    if tensor.dtype in _NUMPY_DTYPES:
        if tensor.device.type != "cpu":  # the copy to the host is already a fresh array
            return tensor.contiguous().cpu().numpy()
        return np.array(tensor.numpy(), copy=True, order="C")
    bits = _BITS.get(tensor.dtype.itemsize)
    if bits is None or tensor.is_quantized:
        raise TypeError(f"tensors of dtype {tensor.dtype} cannot be saved")
    raw = tensor.contiguous().view(bits).cpu().numpy()
    return {TENSOR_TAG: str(tensor.dtype).removeprefix("torch."), "bits": np.array(raw, copy=True)}


def is_tensor_record(value: Any) -> bool:
    """Whether *value* is a tagged record made by :func:`tensor_to_plain`."""
    return isinstance(value, Mapping) and TENSOR_TAG in value


def plain_to_tensor(
    value: np.ndarray | Mapping[str, Any], device: torch.device | None = None
) -> torch.Tensor:
    """Undo :func:`tensor_to_plain`: a fresh tensor (never sharing the caller's memory).

    :raises ValueError: for a record naming an unknown dtype or whose bits do not fit it.
    """
    if isinstance(value, np.ndarray):
        tensor = torch.from_numpy(np.array(value, copy=True))
    else:
        name, bits = value.get(TENSOR_TAG), value.get("bits")
        dtype = getattr(torch, str(name), None)
        if not isinstance(dtype, torch.dtype) or not isinstance(bits, np.ndarray):
            raise ValueError(f"not a tensor record: dtype {name!r}, bits {type(bits).__name__}")
        if bits.dtype.itemsize != dtype.itemsize:
            raise ValueError(f"tensor record of {name}: bits of {bits.dtype} have the wrong item size")
        tensor = torch.from_numpy(np.array(bits, copy=True)).view(dtype)
    return tensor.to(device) if device is not None else tensor


def plain_dtype_and_shape(value: Any) -> tuple[str, tuple[int, ...]] | None:
    """The torch dtype name and shape a plain value stands for (None if it is no tensor)."""
    if isinstance(value, np.ndarray):
        try:
            dtype = torch.from_numpy(np.empty(0, value.dtype.newbyteorder("="))).dtype
        except TypeError:
            return None
        return str(dtype).removeprefix("torch."), tuple(value.shape)
    if is_tensor_record(value) and isinstance(value.get("bits"), np.ndarray):
        return str(value[TENSOR_TAG]), tuple(value["bits"].shape)
    return None


def to_plain(value: Any) -> Any:
    """Tensors → plain records (see the module's docstring); tuples → lists; dicts kept."""
    if isinstance(value, torch.Tensor):
        return tensor_to_plain(value)
    if isinstance(value, (tuple, list)):
        return [to_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {k: to_plain(v) for k, v in value.items()}
    return value


def from_plain(value: Any, template: Any = None, device: torch.device | None = None) -> Any:
    """Undo :func:`to_plain`, restoring the tuples and tensors of *template* where it has them.

    Arrays and records become tensors on *device* (or the template tensor's device).
    """
    if isinstance(value, np.ndarray) or is_tensor_record(value):
        if isinstance(template, torch.Tensor):
            device = template.device
        return plain_to_tensor(value, device)
    if isinstance(value, list):
        items = template if isinstance(template, (list, tuple)) else [None] * len(value)
        out = [from_plain(v, t, device) for v, t in zip(value, list(items) + [None] * len(value))]
        return tuple(out) if isinstance(template, tuple) else out
    if isinstance(value, Mapping):
        sub = template if isinstance(template, Mapping) else {}
        return {k: from_plain(v, sub.get(k), device) for k, v in value.items()}
    return value
