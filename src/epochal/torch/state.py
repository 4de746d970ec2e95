"""Tensors as plain data: numpy arrays, numbers, strings, lists and dicts, never pickle.

A checkpoint of epochal holds numpy arrays and JSON values. Tensors of a dtype numpy has
(float16/32/64, complex64/128, bool, signed and unsigned integers) become a numpy array of
themselves. Tensors of a dtype numpy lacks (bfloat16, the float8 and float4 variants, complex32)
become a *tagged record* ``{"__tensor__": "bfloat16", "bits": uint16 array}``: their raw bits
in an unsigned array of the same item size, and torch's name of the dtype. Both round-trip
bitwise, 0-d, empty and non-contiguous tensors included, and load onto any device.

By default both directions copy: the arrays of :func:`to_plain` and the tensors of
:func:`from_plain` share no memory with their source. With ``share=True`` (what
:class:`~epochal.torch.TorchModel` uses for checkpoints, issue 32) no byte is copied that need
not be:

- :func:`to_plain` hands out **read-only views** of contiguous CPU tensors, as torch's own
  ``state_dict`` hands out aliases: they change when the tensors do (a synchronous checkpoint
  writes them before training goes on; an asynchronous one snapshots them once). A tensor on
  another device is copied to the host once, a non-contiguous one made contiguous once: those
  copies are marked :func:`~epochal.private_arrays.private`, so that an asynchronous save
  writes them without copying them again.
- Inside :func:`pinned_host_copies`, a CUDA tensor is copied into **page-locked** host memory
  (from torch's caching host allocator, so the memory of one save serves the next) without
  waiting, and the block waits once, at its end, for all its copies: a copy at the bus's speed
  instead of through pageable memory touched fresh at each save.
- :func:`from_plain` makes tensors **on** writable, aligned, C-contiguous arrays of native byte
  order (a checkpoint just read) and marks each such array read-only: the tensor now owns that
  memory, and a second load of the same array copies instead of sharing it with a second model.
  Any other array (read-only, Fortran-ordered, big-endian, bound for another device) is copied
  once.

A reader can also land a checkpoint in the tensors' own memory: :func:`destination` is a
writable array (or tagged record) on a live CPU tensor's bytes, and :func:`in_place` tells a
loader that a value read is that tensor's memory already, so nothing is copied or swapped.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch

from epochal.private_arrays import private

__all__ = [
    "TENSOR_TAG",
    "destination",
    "destinations",
    "from_plain",
    "from_plain_or_live",
    "in_place",
    "is_tensor_record",
    "pinned_host_copies",
    "plain_dtype_and_shape",
    "reading_tensor",
    "shareable",
    "to_plain",
]

#: The key that marks a tagged tensor record.
TENSOR_TAG = "__tensor__"
_BITS = {1: torch.uint8, 2: torch.uint16, 4: torch.int32, 8: torch.int64}


#: the torch dtypes numpy has an equal of (the others are saved as their bits).
_NUMPY_DTYPES = {
    torch.bool, torch.uint8, torch.uint16, torch.uint32, torch.uint64,
    torch.int8, torch.int16, torch.int32, torch.int64,
    torch.float16, torch.float32, torch.float64, torch.complex64, torch.complex128,
}  # fmt: skip


#: the CUDA devices whose copies into page-locked memory the innermost pinned_host_copies()
#: block waits for at its end (None: outside such a block)
_PENDING: contextvars.ContextVar[set[torch.device] | None] = contextvars.ContextVar("pending", default=None)


@contextlib.contextmanager
def pinned_host_copies(enabled: bool = True) -> Iterator[None]:
    """Inside this block, :func:`to_plain` with ``share=True`` copies each CUDA tensor into
    page-locked host memory without waiting for the copy; the block waits for all of them at its
    end (also when it ends by an exception), so the arrays may only be read after it.

    The page-locked memory comes from torch's caching host allocator: freed with the arrays, it
    is kept for the next save (the price: about the state's size of host memory that cannot be
    swapped out, held from the first save on). With *enabled* False the block changes nothing.
    """
    if not enabled or not torch.cuda.is_available():
        yield
        return
    pending: set[torch.device] = set()
    token = _PENDING.set(pending)
    try:
        yield
    finally:
        _PENDING.reset(token)
        for device in pending:
            torch.cuda.current_stream(device).synchronize()


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    """*tensor* copied to the host, C-contiguous: into page-locked memory without waiting inside
    :func:`pinned_host_copies` for a CUDA tensor, else ``.cpu()`` (waits for the copy)."""
    pending = _PENDING.get()
    if pending is None or tensor.device.type != "cuda":
        return tensor.contiguous().cpu()
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)  # on the current stream: after the work queued there
    pending.add(tensor.device)
    return host


def _read_only(array: np.ndarray) -> np.ndarray:
    view = array.view()  # the flag is the view's own: the tensor stays writable
    view.flags.writeable = False
    return view


def tensor_to_plain(tensor: torch.Tensor, share: bool = False) -> np.ndarray | dict[str, Any]:
    """A C-contiguous numpy array of *tensor*, or a tagged record when numpy lacks its dtype.

    A copy; with *share*, a read-only view of a contiguous CPU tensor (see the module's docstring).
    """
    tensor = tensor.detach().resolve_conj().resolve_neg()
    fresh = tensor.device.type != "cpu" or not tensor.is_contiguous()
    if fresh:
        tensor = _to_host(tensor) if share else tensor.contiguous().cpu()
    if tensor.dtype in _NUMPY_DTYPES:
        raw = tensor.numpy()
    else:
        bits = _BITS.get(tensor.dtype.itemsize)
        if bits is None or tensor.is_quantized:
            raise TypeError(f"tensors of dtype {tensor.dtype} cannot be saved")
        raw = tensor.view(bits).numpy()
    if not fresh:
        raw = _read_only(raw) if share else np.array(raw, copy=True)
    elif share:  # made for this state alone: an asynchronous save writes it without a copy
        private(raw)
    if tensor.dtype in _NUMPY_DTYPES:
        return raw
    return {TENSOR_TAG: str(tensor.dtype).removeprefix("torch."), "bits": raw}


def is_tensor_record(value: Any) -> bool:
    """Whether *value* is a tagged record made by :func:`tensor_to_plain`."""
    return isinstance(value, Mapping) and TENSOR_TAG in value


def _array_and_dtype(value: np.ndarray | Mapping[str, Any]) -> tuple[np.ndarray, torch.dtype | None]:
    """The array behind a plain tensor and, for a tagged record, the torch dtype to view it as.

    :raises ValueError: for a record naming an unknown dtype or whose bits do not fit it.
    """
    if isinstance(value, np.ndarray):
        return value, None
    name, bits = value.get(TENSOR_TAG), value.get("bits")
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype) or not isinstance(bits, np.ndarray):
        raise ValueError(f"not a tensor record: dtype {name!r}, bits {type(bits).__name__}")
    if bits.dtype.itemsize != dtype.itemsize:
        raise ValueError(f"tensor record of {name}: bits of {bits.dtype} have the wrong item size")
    return bits, dtype


def _native(array: np.ndarray) -> np.ndarray:
    """*array* in native byte order (torch refuses the other one): itself, or a copy."""
    return array if array.dtype.isnative else array.astype(array.dtype.newbyteorder("="))


def _shareable_array(array: np.ndarray) -> bool:
    flags = array.flags
    return bool(flags.writeable and flags.aligned and flags.c_contiguous and array.dtype.isnative)


def shareable(value: Any) -> bool:
    """Whether :func:`from_plain` with ``share=True`` would build a CPU tensor on *value*'s memory."""
    try:
        array, _ = _array_and_dtype(value)
    except (ValueError, AttributeError):
        return False
    return _shareable_array(array)


def reading_tensor(value: np.ndarray | Mapping[str, Any]) -> torch.Tensor:
    """A CPU tensor on *value*'s memory (no copy, unless its byte order is not native), **to
    read only**, e.g. as the source of one ``copy_`` into a parameter: it may alias an array
    marked read-only.

    :raises ValueError: for a record naming an unknown dtype or whose bits do not fit it.
    """
    array, dtype = _array_and_dtype(value)
    array = _native(array)
    if array.flags.writeable:
        tensor = torch.from_numpy(array)
    else:
        with warnings.catch_warnings():  # "not writable": it is only read
            warnings.simplefilter("ignore", UserWarning)
            tensor = torch.from_numpy(array)
    return tensor.view(dtype) if dtype is not None else tensor


def plain_to_tensor(
    value: np.ndarray | Mapping[str, Any], device: torch.device | None = None, share: bool = False
) -> torch.Tensor:
    """Undo :func:`tensor_to_plain`: a fresh tensor (never sharing the caller's memory), or
    with *share* a CPU tensor on the array's memory where it can be (the module's docstring).

    :raises ValueError: for a record naming an unknown dtype or whose bits do not fit it.
    """
    array, dtype = _array_and_dtype(value)
    to_host = device is None or torch.device(device).type == "cpu"
    if share and to_host and _shareable_array(array):
        tensor = torch.from_numpy(array)
        array.flags.writeable = False  # taken: a second load copies
    elif not to_host:
        tensor = reading_tensor(array)  # the transfer to the device is the one copy
    else:
        tensor = torch.from_numpy(np.array(array, dtype=array.dtype.newbyteorder("="), order="C"))
    if dtype is not None:
        tensor = tensor.view(dtype)
    return tensor.to(device) if device is not None else tensor


def destination(tensor: torch.Tensor) -> np.ndarray | dict[str, Any] | None:
    """A **writable** array on *tensor*'s own memory, shaped as :func:`tensor_to_plain` saves it
    (a tagged record for dtypes numpy lacks), for a reader to read a checkpoint straight into;
    None where the tensor's memory cannot take it as it is (not a plain contiguous CPU tensor).
    """
    if (
        type(tensor) not in (torch.Tensor, torch.nn.Parameter)
        or tensor.device.type != "cpu"
        or not tensor.is_contiguous()
        or tensor.is_conj()
        or tensor.is_neg()
        or tensor.is_quantized
    ):
        return None
    tensor = tensor.detach()
    if tensor.dtype in _NUMPY_DTYPES:
        return tensor.numpy()
    bits = _BITS.get(tensor.dtype.itemsize)
    if bits is None:
        return None
    return {TENSOR_TAG: str(tensor.dtype).removeprefix("torch."), "bits": tensor.view(bits).numpy()}


def destinations(tensors: Mapping[str, Any]) -> dict[str, Any]:
    """:func:`destination` of each tensor of *tensors* that has one, by the same keys."""
    out = {}
    for key, tensor in tensors.items():
        if isinstance(tensor, torch.Tensor) and (view := destination(tensor)) is not None:
            out[key] = view
    return out


def from_plain_or_live(saved: Any, live: Any) -> Any:
    """*saved* (a table of plain values, e.g. one parameter's optimizer state) as tensors: the
    tensor of *live* (the same keys) where a value is that tensor's memory already
    (:func:`in_place`), elsewhere :func:`from_plain` with ``share=True``."""
    if not isinstance(saved, Mapping) or not isinstance(live, Mapping):
        return from_plain(saved, share=True)
    return {
        k: live[k]
        if isinstance(live.get(k), torch.Tensor) and in_place(v, live[k])
        else from_plain(v, share=True)
        for k, v in saved.items()
    }


@functools.lru_cache(maxsize=256)
def _torch_dtype(dtype: np.dtype[Any]) -> tuple[torch.dtype, str] | None:
    """The torch dtype (and its name) of arrays of numpy *dtype* in native byte order; None
    where torch has none. Cached: a state of hundreds of tensors holds a few dtypes."""
    try:
        found = torch.from_numpy(np.empty(0, dtype.newbyteorder("="))).dtype
    except TypeError:
        return None
    return found, str(found).removeprefix("torch.")


def in_place(value: Any, tensor: torch.Tensor) -> bool:
    """Whether *value* (an array or tagged record) is *tensor*'s own memory, of its dtype and
    shape: what a reader filled through :func:`destination`; loading it changes nothing more."""
    try:
        array, dtype = _array_and_dtype(value)
    except (ValueError, AttributeError):
        return False
    if tensor.device.type != "cpu" or not tensor.is_contiguous() or tuple(array.shape) != tuple(tensor.shape):
        return False
    if dtype is None:
        known = _torch_dtype(array.dtype) if array.dtype.isnative else None
        if known is None:
            return False
        dtype = known[0]
    return bool(
        dtype == tensor.dtype
        and array.nbytes == tensor.nbytes
        and (array.size == 0 or array.__array_interface__["data"][0] == tensor.data_ptr())
    )


def plain_dtype_and_shape(value: Any) -> tuple[str, tuple[int, ...]] | None:
    """The torch dtype name and shape a plain value stands for (None if it is no tensor)."""
    if isinstance(value, np.ndarray):
        known = _torch_dtype(value.dtype)
        return None if known is None else (known[1], tuple(value.shape))
    if is_tensor_record(value) and isinstance(value.get("bits"), np.ndarray):
        return str(value[TENSOR_TAG]), tuple(value["bits"].shape)
    return None


def to_plain(value: Any, share: bool = False) -> Any:
    """Tensors → plain records (see the module's docstring); tuples → lists; dicts kept.

    With *share*, arrays are read-only views of contiguous CPU tensors instead of copies.
    """
    if isinstance(value, torch.Tensor):
        return tensor_to_plain(value, share)
    if isinstance(value, (tuple, list)):
        return [to_plain(v, share) for v in value]
    if isinstance(value, Mapping):
        return {k: to_plain(v, share) for k, v in value.items()}
    return value


def from_plain(
    value: Any, template: Any = None, device: torch.device | None = None, share: bool = False
) -> Any:
    """Undo :func:`to_plain`, restoring the tuples and tensors of *template* where it has them.

    Arrays and records become tensors on *device* (or the template tensor's device): copies,
    or with *share* CPU tensors on the arrays' memory where they can be (the module's docstring).
    """
    if isinstance(value, np.ndarray) or is_tensor_record(value):
        if isinstance(template, torch.Tensor):
            device = template.device
        return plain_to_tensor(value, device, share)
    if isinstance(value, list):
        items = template if isinstance(template, (list, tuple)) else [None] * len(value)
        out = [from_plain(v, t, device, share) for v, t in zip(value, list(items) + [None] * len(value))]
        return tuple(out) if isinstance(template, tuple) else out
    if isinstance(value, Mapping):
        sub = template if isinstance(template, Mapping) else {}
        return {k: from_plain(v, sub.get(k), device, share) for k, v in value.items()}
    return value
