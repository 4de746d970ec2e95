"""The ``.npy`` record headers of ``data.bin``: written by numpy, parsed by a bounded parser here.

A header is numpy's: the magic ``\\x93NUMPY``, the version (1.0 or 2.0), the header's length,
then a Python dict literal ``{'descr': ..., 'fortran_order': ..., 'shape': (...)}``.
:func:`parse_npy_header` reads it without numpy's header reader: numpy filters the text through
:mod:`tokenize`, which raises ``tokenize.TokenError`` on an unbalanced bracket (one damaged
byte), an exception no caller expects. Here the header is bounded (64 KiB), parsed with
:func:`ast.literal_eval` (literals only: no name is looked up, no code runs), and every key and
type is checked; whatever is wrong ends in :class:`CorruptCheckpointError` (an object dtype,
a pickle payload, in :class:`UnsafeCheckpointError`), never in another exception.

The header numpy writes for a tensor's array (a plain dtype such as ``'<f4'``, a shape of
integers) is matched by a regular expression first, which reads it ~7x faster than
:func:`ast.literal_eval` (3 against 21 µs; a model of hundreds of tensors has hundreds of
records per load). Any other header, damaged ones included, takes the general path, and both
end in the same checks.
"""

from __future__ import annotations

import ast
import functools
import io
import re
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from epochal_checkpoint.errors import CorruptCheckpointError, UnsafeCheckpointError

if TYPE_CHECKING:
    import numpy as np

MAGIC = b"\x93NUMPY"
#: the longest header text read (numpy's own default limit).
MAX_HEADER = 1 << 16
#: how many bytes a reader fetches to be sure to hold a whole header.
NPY_HEADER_MAX = MAX_HEADER + 16
#: how many bytes a reader fetches first: numpy's header of a tensor's array is 128 bytes; a
#: longer one (:func:`header_size`) is read again whole.
NPY_HEADER_FIRST = 1024
#: numpy's limit on the number of dimensions.
MAX_DIMS = 64
#: the header length field's size, by version.
_LENGTH_BYTES = {(1, 0): 2, (2, 0): 4}
_KEYS = frozenset({"descr", "fortran_order", "shape"})
_MAX_DIM = 1 << 62
_DIM = r"(?:0|[1-9][0-9]{0,18})"  # as Python writes an int: no sign, no leading zero
#: the header numpy writes for a plain dtype, as ``repr`` of its dict, padded: the keys in order,
#: a shape of ``()``, ``(n,)`` or ``(n, m, ...)`` (what literal_eval reads as that tuple).
_PLAIN = re.compile(
    rf"\{{'descr': '([<>|=][a-zA-Z][0-9]{{1,3}})', 'fortran_order': (False|True), "
    rf"'shape': \((|{_DIM},|{_DIM}(?:, {_DIM})+)\), \}} *\n"
)


def npy_header(array: np.ndarray) -> bytes:
    """The ``.npy`` header of *array* (version 1.0, or 2.0 above 64 KiB), as numpy writes it.

    Written by numpy once per dtype, shape and order, then kept: a save of a model's tensors
    asks for the same few headers at every save (numpy builds one in ~4 µs, a lookup is ~0.4)."""
    flags = array.flags  # numpy's rule: C order unless only Fortran-contiguous
    return _header(array.dtype, array.shape, not flags.c_contiguous and flags.f_contiguous)


@functools.lru_cache(maxsize=4096)
def _header(dtype: np.dtype[Any], shape: tuple[int, ...], fortran: bool) -> bytes:
    import numpy as np

    header = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": fortran, "shape": shape}
    buffer = io.BytesIO()
    try:
        np.lib.format.write_array_header_1_0(buffer, header)
    except ValueError:  # a header longer than 64 KiB (huge structured dtypes)
        buffer = io.BytesIO()
        np.lib.format.write_array_header_2_0(buffer, header)
    return buffer.getvalue()


def header_size(head: bytes) -> int | None:
    """The length (magic and length field included) that the header at the start of *head*
    declares, or None where *head* does not start with one (:func:`parse_npy_header` says why)."""
    size = _LENGTH_BYTES.get((head[6], head[7])) if len(head) >= 8 and head[:6] == MAGIC else None
    if size is None or len(head) < 8 + size:
        return None
    return 8 + size + int.from_bytes(head[8 : 8 + size], "little")


def _unsafe(where: str) -> UnsafeCheckpointError:
    return UnsafeCheckpointError(
        f"{where} holds a pickle payload (object dtype); epochal never unpickles "
        "checkpoint data, refusing to load it"
    )


def parse_npy_header(where: str, head: bytes) -> tuple[tuple[int, ...], bool, np.dtype[Any], int]:
    """Parse the ``.npy`` header at the start of *head*; return shape, Fortran order, dtype and the
    header's length (magic and length field included). *where* names the record in errors.

    :raises CorruptCheckpointError: for anything but a well-formed header of version 1.0 or 2.0.
    :raises UnsafeCheckpointError: for an object dtype (a pickle payload).
    """
    import numpy as np

    def bad(why: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{where} has a bad .npy header: {why}")

    if len(head) < 8 or head[:6] != MAGIC:
        raise bad("no .npy magic string")
    version = (head[6], head[7])
    size = _LENGTH_BYTES.get(version)
    if size is None:
        raise bad(f"unsupported .npy version {version[0]}.{version[1]}")
    start = 8 + size
    if len(head) < start:
        raise bad("truncated")
    length = int.from_bytes(head[8:start], "little")
    if length > MAX_HEADER:
        raise bad(f"{length} bytes long, more than the {MAX_HEADER} allowed")
    end = start + length
    if end > len(head):
        raise bad(f"truncated ({len(head) - start} of {length} bytes)")
    text = bytes(head[start:end]).decode("latin-1")
    plain = _PLAIN.fullmatch(text)
    if plain is not None:
        descr: Any = plain[1]
        fortran: Any = plain[2] == "True"
        shape: Any = tuple(int(n) for n in plain[3].split(",") if n)
    else:
        shape, fortran, descr = _literal_header(text, bad)
    if (
        type(shape) is not tuple
        or len(shape) > MAX_DIMS
        or not all(type(n) is int and 0 <= n < _MAX_DIM for n in shape)
    ):
        raise bad(f"shape {shape!r:.100} is not a tuple of at most {MAX_DIMS} non-negative ints")
    if type(fortran) is not bool:
        raise bad(f"fortran_order {fortran!r:.100} is not a bool")
    if type(descr) not in (str, list):
        raise bad(f"descr {descr!r:.100} is not a dtype description")
    try:
        dtype = np.lib.format.descr_to_dtype(descr)
    except Exception as error:  # TypeError, ValueError, KeyError, RecursionError...
        raise bad(f"descr {descr!r:.100} is not a dtype ({type(error).__name__})") from None
    if dtype.hasobject:
        raise _unsafe(where)
    return shape, fortran, dtype, end


def _literal_header(text: str, bad: Callable[[str], CorruptCheckpointError]) -> tuple[Any, Any, Any]:
    """The shape, Fortran order and descr of any header text, read with :func:`ast.literal_eval`
    (unchecked beyond the dict's keys); *bad* makes the error for text that is no such dict."""
    try:
        # a damaged header can hold an invalid escape ("\\d"): Python's parser then warns on
        # stderr about the text (DeprecationWarning, SyntaxWarning): not ours to show
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            header = ast.literal_eval(text)
    except Exception as error:  # SyntaxError, ValueError, MemoryError, RecursionError...
        raise bad(f"not a dict literal ({type(error).__name__}: {str(error)[:100]})") from None
    if type(header) is not dict or header.keys() != _KEYS:
        keys = sorted(map(repr, header)) if type(header) is dict else type(header).__name__
        raise bad(f"not a dict of descr, fortran_order and shape ({keys!s:.200})")
    return header["shape"], header["fortran_order"], header["descr"]
