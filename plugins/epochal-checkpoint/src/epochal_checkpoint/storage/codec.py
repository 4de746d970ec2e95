"""Encoding a state: flattening it into JSON and arrays, ``data.bin``'s pieces, the manifest's text
and its seal (the commit record). No file is touched here.

A state is split by :func:`flatten` into a JSON tree (``null`` where an array or a huge int sits)
and its arrays; :func:`encode` lays them out as ``data.bin``: every array's ``.npy`` record
(header, then the array's own memory: nothing copied), then the JSON state with the index of the
arrays (key path, offset, dtype, shape, CRC-32 of the record). :func:`manifest_text` writes a
manifest with one top-level key per line, and :func:`seal` appends its commit record: the CRC-32
of every byte before the record's digits.
"""

from __future__ import annotations

import json
import math
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from epochal.private_arrays import is_private
from epochal_checkpoint.errors import UnsupportedStateError
from epochal_checkpoint.storage.npy import npy_header

try:  # zlib-ng's CRC-32 is zlib's checksum (same values), computed ~15x faster with SIMD
    from zlib_ng.zlib_ng import crc32
except ImportError:  # pragma: no cover - a platform without zlib-ng wheels
    from zlib import crc32

if TYPE_CHECKING:
    import numpy as np

__all__ = [
    "BIG_INT_BITS",
    "DATA",
    "FORMAT",
    "FORMAT_VERSION",
    "MANIFEST",
    "OWN",
    "SEAL_RE",
    "SEGMENTS",
    "PathKey",
    "Snapshot",
    "crc32",
    "encode",
    "flatten",
    "is_finite_number",
    "key_path",
    "manifest_text",
    "seal",
]

FORMAT = "epochal-checkpoint"
#: the one on-disk format version written and read.
FORMAT_VERSION = 4
#: the manifest key listing the log segments, in reading order.
SEGMENTS = "log_segments"
MANIFEST = "manifest.json"
#: the manifest key listing the checkpoints this run family wrote and keeps (rotation's record).
OWN = "written"
#: the one data file: the arrays' ``.npy`` records, then the JSON state.
DATA = "data.bin"
#: the commit record: the manifest's last key, the CRC-32 of every byte before its digits.
SEAL_RE = re.compile(rb'"commit": "([0-9a-f]{8})"\n\}\n\Z')
#: above this many bits an int is stored as hex text (Python refuses to parse > 4300 digits).
BIG_INT_BITS = 4000

_SCALARS = (str, bool, float, type(None))
_NUMBERS = frozenset({int, float, bool})
#: value types of a dict copied as it is by :func:`flatten` (ints: checked against the limit).
_PLAIN = frozenset({str, bool, float, type(None), int})
_INT_LIMIT = 1 << BIG_INT_BITS
PathKey = str | int


def _plain_dict(value: Any) -> bool:
    """Whether the dict *value* has only str keys and scalar values (str, bool, float, None, ints
    within :data:`BIG_INT_BITS` bits): a log row or a plugin's counters, copied at C speed."""
    if not set(map(type, value.values())) <= _PLAIN or not all(type(key) is str for key in value):
        return False
    return all(-_INT_LIMIT < v < _INT_LIMIT for v in value.values() if type(v) is int)


def _plain_numbers(items: Any) -> bool:
    """Whether *items* holds only ints (none above :data:`BIG_INT_BITS` bits), floats and bools:
    a list saved as it is (a random generator's 625 ints), checked without a call per item."""
    if len(items) < 8 or not set(map(type, items)) <= _NUMBERS:
        return False
    # min and max skip no int: a NaN first makes them NaN, and NaN fails both comparisons
    return min(items) > -_INT_LIMIT and max(items) < _INT_LIMIT


def key_path(path: Sequence[PathKey]) -> str:
    """``("plugins", "monitor", "state", "foo", 3)`` → ``plugins.monitor.state.foo[3]``."""
    text = ""
    for key in path:
        text += f"[{key}]" if isinstance(key, int) else (f".{key}" if text else str(key))
    return text or "<root>"


def is_finite_number(value: Any) -> bool:
    """Whether *value* is a real, finite number (a usable metric)."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        return False
    return not isinstance(value, bool) and math.isfinite(number)


@dataclass
class Snapshot:
    """A state split into a JSON tree (arrays replaced by ``None``) and its arrays."""

    tree: Any
    arrays: list[np.ndarray] = field(default_factory=list)
    index: list[dict[str, Any]] = field(default_factory=list)
    ints: list[dict[str, Any]] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        """The bytes of array data."""
        return sum(a.nbytes for a in self.arrays)


def flatten(state: Any, copy_arrays: bool = False, reuse: Sequence[np.ndarray] = ()) -> Snapshot:
    """Split *state* into a :class:`Snapshot`, checking every value.

    Containers are rebuilt (later changes to *state* do not reach the snapshot); arrays are
    copied only when *copy_arrays* is true (asynchronous saves), into the arrays of *reuse*
    (a previous snapshot's, no longer in use) where shape and dtype match: copying into memory
    already touched is 2x faster than into fresh pages. An array the model made for this state
    alone (marked :func:`epochal.private_arrays.private`: a GPU tensor's copy on the host) is
    kept as it is even then. Tuples become lists.

    :raises UnsupportedStateError: for a value that is not a numpy array or scalar, a number,
        a string, a bool, None, a list, a tuple or a dict with string keys, naming its key path.
    """
    import numpy as np

    snapshot = Snapshot(None)
    path: list[PathKey] = []
    active: set[int] = set()

    def fail(message: str) -> UnsupportedStateError:
        return UnsupportedStateError(f"cannot save state key {key_path(path)!r}: {message}")

    def array_leaf(value: Any, kind: str) -> None:
        masked = sys.modules.get("numpy.ma")  # numpy.ma is imported lazily: never import it here
        if masked is not None and isinstance(value, masked.MaskedArray):
            raise fail("masked arrays are not supported (save .data and .mask separately)")
        array = np.asarray(value)
        if array.dtype.hasobject or not getattr(type(array.dtype), "_legacy", True):
            raise fail(f"arrays of dtype {array.dtype} cannot be saved without pickle")
        if copy_arrays and not is_private(array):
            k = len(snapshot.arrays)
            spare = reuse[k] if k < len(reuse) else None
            if spare is not None and spare.shape == array.shape and spare.dtype == array.dtype:
                np.copyto(spare, array)
                array = spare
            else:
                array = np.array(array, order="C", copy=True)
        elif not array.flags.c_contiguous:
            array = np.array(array, order="C", copy=True)
        snapshot.index.append(
            {"path": list(path), "kind": kind, "dtype": array.dtype.str, "shape": list(array.shape)}
        )
        snapshot.arrays.append(array)

    def walk(value: Any) -> Any:
        kind = type(value)
        if kind in _SCALARS:
            return value
        if kind is int:
            if value.bit_length() > BIG_INT_BITS:
                snapshot.ints.append({"path": list(path), "hex": hex(value)})
                return None
            return value
        if isinstance(value, np.ndarray):
            array_leaf(value, "array")
            return None
        if isinstance(value, np.generic):
            array_leaf(value, "scalar")
            return None
        if isinstance(value, (dict, list, tuple, Mapping)):
            if id(value) in active:
                raise fail("the state contains itself (a reference cycle)")
            if (kind is list or kind is tuple) and _plain_numbers(value):
                return list(value)  # nothing in it to check or to replace, at C speed
            if kind is dict and _plain_dict(value):
                return dict(value)  # the same for a dict of scalars
            active.add(id(value))
            try:
                if isinstance(value, (list, tuple)):
                    out: Any = []
                    for i, item in enumerate(value):
                        path.append(i)
                        out.append(walk(item))
                        path.pop()
                else:
                    out = {}
                    for key, item in value.items():
                        if type(key) is not str:
                            raise fail(f"dict key {key!r} is an {type(key).__name__}, not a str")
                        path.append(key)
                        out[key] = walk(item)
                        path.pop()
            finally:
                active.discard(id(value))
            return out
        for base in (bool, int, float, str):  # subclasses (IntEnum, numpy float64...) → base
            if isinstance(value, base):
                return walk(base(value))
        raise fail(
            f"{type(value).__module__}.{type(value).__qualname__} is not a numpy array, number, "
            "string, bool, None, list or dict"
        )

    snapshot.tree = walk(state)
    return snapshot


def _raw(array: np.ndarray) -> memoryview:
    import numpy as np

    raw: Any = array.reshape(-1).view(np.uint8)
    return memoryview(raw)


def encode(snapshot: Snapshot) -> tuple[list[memoryview | bytes], dict[str, Any]]:
    """The pieces of ``data.bin`` for *snapshot*, and its manifest entry.

    The arrays' ``.npy`` records (header, then the array's own memory: nothing is copied) come
    first, each with its offset and CRC-32 in the index; the JSON state follows. The manifest
    entry gives the file's size, the state's offset and the state's CRC-32, so a reader can check
    the state first and then read (and check) only the arrays it wants.
    """
    pieces: list[memoryview | bytes] = []
    offset = 0
    for entry, array in zip(snapshot.index, snapshot.arrays):
        header, raw = npy_header(array), _raw(array)
        entry["offset"] = offset
        entry["crc32"] = f"{crc32(raw, crc32(header)):08x}"
        offset += len(header) + raw.nbytes
        pieces += [header, raw]
    document = {
        "format": f"{FORMAT}-state",
        "version": FORMAT_VERSION,
        "tree": snapshot.tree,
        "arrays": snapshot.index,
        "ints": snapshot.ints,
    }
    state = json.dumps(document, separators=(",", ":"), allow_nan=True).encode("ascii")
    pieces.append(state)
    return pieces, {"size": offset + len(state), "crc32": f"{crc32(state):08x}", "state": offset}


_dumps = json.JSONEncoder(separators=(", ", ": ")).encode


def manifest_text(document: Mapping[str, Any]) -> bytes:
    """*document* as a manifest's JSON: a top-level key per line, each value on its line.

    Each value goes through the C encoder (``indent`` would switch every level to the pure-Python
    one, ~3x slower on a save's critical path); any JSON reader parses it alike.
    """
    items = [f" {_dumps(key)}: {_dumps(value)}" for key, value in document.items()]
    return ("{\n" + ",\n".join(items) + "\n}").encode("ascii")


def seal(manifest: bytes) -> bytes:
    """*manifest* (a JSON object's bytes) with its commit record as the last key: the CRC-32 of
    every byte before the record's digits. An existing record is replaced."""
    sealed = SEAL_RE.search(manifest, max(len(manifest) - 64, 0))
    if sealed is not None:
        head = manifest[: sealed.start(1)]
    else:
        body = manifest.rstrip()
        head = (body[:-1].rstrip() if body.endswith(b"}") else body) + b',\n "commit": "'
    return head + f'{crc32(head):08x}"\n}}\n'.encode("ascii")
