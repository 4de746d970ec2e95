"""Reading a checkpoint back: ``data.bin``'s state and arrays, its log, and the newest that verifies.

:func:`read_checkpoint_info` checks the JSON state against the manifest's CRC-32, then reads the
arrays it wants (all, or the model's) into one buffer allocated for them, each checked against
its own CRC-32 on the way, then the log segments. With *into* (a tree of writable arrays shaped
like the state, e.g. views of a model's live tensors: ``TorchModel.load_destinations()``), an
array whose destination has its dtype and shape is checksummed through a small reused buffer
first and read into its destination only once the whole checkpoint has verified (issue 32):
the read lands in its final memory, and a damaged checkpoint leaves the destinations as they
were. :func:`find_latest` / :func:`load_latest` take
the newest complete checkpoint of a directory that verifies, warning about (and stepping over)
the damaged ones.
"""

from __future__ import annotations

import math
import os
import re
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from epochal_checkpoint.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    ForeignCheckpointError,
    UnsafeCheckpointError,
)
from epochal_checkpoint.storage import sharded, sign
from epochal_checkpoint.storage.codec import DATA, FORMAT, MANIFEST, crc32, key_path
from epochal_checkpoint.storage.layout import CheckpointInfo, list_checkpoints
from epochal_checkpoint.storage.npy import NPY_HEADER_FIRST, NPY_HEADER_MAX, header_size, parse_npy_header
from epochal_checkpoint.storage.read import (
    CRC_RE,
    MAX_FILE_BYTES,
    READ_CHUNK,
    corrupt,
    foreign_file_error,
    is_int,
    open_regular,
    parse_json,
    read_into,
    read_manifest,
    read_regular,
)
from epochal_checkpoint.storage.segments import read_segments

if TYPE_CHECKING:
    import numpy as np

__all__ = [
    "ReadCheckpoint",
    "find_latest",
    "load_latest",
    "read_checkpoint",
    "read_checkpoint_info",
    "read_state_document",
    "warn_damaged_segments",
]

HEX_RE = re.compile(r"^-?0x[0-9a-f]{1,1048576}$")
#: the keys of a model state that say where its DCP files are: set by the reader, never read.
SHARD_KEYS = frozenset({"dcp", "dcp_only", "dcp_storage"})


@dataclass
class ReadCheckpoint(CheckpointInfo):
    """A checkpoint read and verified: :class:`CheckpointInfo` and its state."""

    state: dict[str, Any] = field(default_factory=dict)
    #: log segments that failed verification, with why (their rows are lost).
    damaged: list[tuple[str, str]] = field(default_factory=list)


def _check_index(path: Path, index: Any, ints: Any) -> None:
    """Check the array and big-int entries of a state (each array with its offset and CRC-32)."""
    if not isinstance(index, list):
        raise corrupt(path, DATA, "key arrays is not a list")
    for k, entry in enumerate(index):
        if not (
            isinstance(entry, dict)
            and isinstance(entry.get("path"), list)
            and all(type(p) in (str, int) for p in entry["path"])
            and entry.get("kind") in ("array", "scalar")
            and isinstance(entry.get("dtype"), str)
            and len(entry["dtype"]) < 200
            and isinstance(entry.get("shape"), list)
            and len(entry["shape"]) <= 64
            and all(is_int(n) for n in entry["shape"])
            and is_int(entry.get("offset"), 0, MAX_FILE_BYTES)
            and isinstance(entry.get("crc32"), str)
            and CRC_RE.match(entry["crc32"])
        ):
            raise corrupt(path, DATA, f"key arrays[{k}] is not a valid array entry: {entry!r:.200}")
    if not isinstance(ints, list):
        raise corrupt(path, DATA, "key ints is not a list")
    for k, entry in enumerate(ints):
        if not (
            isinstance(entry, dict)
            and isinstance(entry.get("path"), list)
            and all(type(p) in (str, int) for p in entry["path"])
            and isinstance(entry.get("hex"), str)
            and HEX_RE.match(entry["hex"])
        ):
            raise corrupt(path, DATA, f"key ints[{k}] is not a valid big-int entry: {entry!r:.200}")


@dataclass
class _Record:
    """An array record of ``data.bin`` whose header was read and checked."""

    entry: Mapping[str, Any]
    shape: tuple[int, ...]
    fortran: bool
    dtype: Any
    start: int
    nbytes: int
    crc: int  # the CRC-32 of its header, continued over its bytes when they are read


def _record(path: Path, fd: int, entry: Mapping[str, Any], end: int) -> _Record:
    """The header of array *entry* of ``data.bin`` (open as *fd*; its records end at *end*),
    parsed and checked against the index and against *end*."""
    where = f"checkpoint {str(path)!r}: {DATA} array {key_path(entry['path'])!r}"
    offset = entry["offset"]
    if offset >= end:
        raise corrupt(path, DATA, f"key arrays: offset {offset} is past the end of the arrays ({end})")
    try:
        head = os.pread(fd, min(NPY_HEADER_FIRST, end - offset), offset)
        declared = header_size(head)
        if declared is not None and declared > len(head):  # a long header: up to the limit
            head = os.pread(fd, min(NPY_HEADER_MAX, end - offset), offset)
    except OSError as error:
        raise corrupt(path, DATA, f"cannot be read: {error.strerror or error}") from None
    shape, fortran, dtype, length = parse_npy_header(where, head)
    if dtype.str != entry["dtype"] or list(shape) != entry["shape"]:
        raise CorruptCheckpointError(
            f"{where} is {dtype.str} {list(shape)}, the index says {entry['dtype']} {entry['shape']}"
        )
    nbytes = math.prod(shape) * dtype.itemsize
    start = offset + length
    if start + nbytes > end:
        raise CorruptCheckpointError(f"{where} needs {nbytes} bytes, {DATA} has {max(end - start, 0)} left")
    return _Record(entry, shape, fortran, dtype, start, nbytes, crc32(head[:length]))


def _destination(into: Any, record: _Record) -> np.ndarray | None:
    """The array of *into* at *record*'s key path, if the record can be read straight into it:
    a writable C-contiguous numpy array of the record's exact dtype and shape (None: no)."""
    import numpy as np

    if into is None or record.fortran or record.dtype.itemsize == 0 or record.entry["kind"] != "array":
        return None
    try:
        target = _get_path(into, record.entry["path"])
    except (KeyError, IndexError, TypeError):
        return None
    if (
        isinstance(target, np.ndarray)
        and target.dtype == record.dtype
        and target.shape == record.shape
        and target.flags.writeable
        and target.flags.c_contiguous
    ):
        return target
    return None


def _mismatch(path: Path, record: _Record, crc: int) -> CorruptCheckpointError:
    where = f"checkpoint {str(path)!r}: {DATA} array {key_path(record.entry['path'])!r}"
    return CorruptCheckpointError(
        f"{where} fails its checksum (crc32 {crc:08x}, the index says {record.entry['crc32']})"
    )


class Fills:
    """Arrays verified in ``data.bin`` and still to be read into their destinations: run once
    the whole checkpoint has verified (:meth:`run`), or dropped (:meth:`close`)."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path, self.fd = path, os.dup(fd)
        self.pending: list[tuple[_Record, np.ndarray]] = []

    def run(self) -> None:
        """Read every array into its destination, checksummed again on the way.

        :raises CorruptCheckpointError: when ``data.bin`` changed between the verification and
            this read (only a writer inside a committed checkpoint does that); the destinations
            read so far then hold part of it, which the message says.
        """
        import numpy as np

        try:
            for record, target in self.pending:
                view = memoryview(target.reshape(-1).view(np.uint8).data)  # the array's own bytes
                crc = read_into(self.path, DATA, self.fd, view, record.start, record.crc)
                if f"{crc:08x}" != record.entry["crc32"]:
                    raise CorruptCheckpointError(
                        f"{_mismatch(self.path, record, crc)}: {DATA} changed while it was read, after "
                        "it verified; the tensors it was read into hold part of it"
                    )
        finally:
            self.close()

    def close(self) -> None:
        """Drop what is still to be read (a later failure of the checkpoint)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self.pending = []


def _verify_through(path: Path, fd: int, record: _Record, scratch: memoryview) -> None:
    """Check *record*'s CRC-32 by reading it through *scratch* (a small buffer reused: no memory
    of the array's size is taken, and none of the destination is touched)."""
    crc, got, size = record.crc, 0, len(scratch)
    while got < record.nbytes:
        n = min(size, record.nbytes - got)
        crc = read_into(path, DATA, fd, scratch[:n], record.start + got, crc)
        got += n
    if f"{crc:08x}" != record.entry["crc32"]:
        raise _mismatch(path, record, crc)


def _read_records(
    path: Path,
    fd: int,
    entries: Sequence[Mapping[str, Any]],
    end: int,
    into: Any = None,
    fills: Fills | None = None,
) -> list[np.ndarray]:
    """The arrays *entries* of ``data.bin``: every header checked first, then the arrays read
    into one buffer allocated for them (64-byte aligned slices; one allocation is markedly
    faster than one per array), each checksummed while it is read. Records may not overlap, so
    the buffer is never larger than the file. An array with a destination in *into*
    (:func:`_destination`) is only verified here and queued on *fills*; its destination is
    returned in its place."""
    import numpy as np

    records = [_record(path, fd, entry, end) for entry in entries]
    previous = 0
    for record in sorted(records, key=lambda r: r.entry["offset"]):
        if record.entry["offset"] < previous:
            where = key_path(record.entry["path"])
            raise corrupt(path, DATA, f"key arrays: array {where!r} overlaps the array before it")
        previous = record.start + record.nbytes
    targets = [_destination(into, record) if fills is not None else None for record in records]
    places, total = [], 0
    for record, target in zip(records, targets, strict=True):
        places.append(total)
        total += 0 if target is not None else -(-record.nbytes // 64) * 64
    buffer = np.empty(total + 64, np.uint8)
    base = -buffer.ctypes.data % 64
    scratch = memoryview(bytearray(READ_CHUNK)) if any(t is not None for t in targets) else None
    arrays = []
    for record, at, target in zip(records, places, targets, strict=True):
        if target is not None and fills is not None and scratch is not None:
            _verify_through(path, fd, record, scratch)
            fills.pending.append((record, target))
            arrays.append(target)
            continue
        piece = buffer[base + at : base + at + record.nbytes]
        crc = read_into(path, DATA, fd, memoryview(piece.data), record.start, record.crc)
        if f"{crc:08x}" != record.entry["crc32"]:
            raise _mismatch(path, record, crc)
        order = "F" if record.fortran else "C"
        if record.dtype.itemsize == 0:
            arrays.append(np.zeros(record.shape, record.dtype))
        else:
            arrays.append(piece.view(record.dtype).reshape(record.shape, order=order))
    return arrays


def _get_path(tree: Any, path: Sequence[Any]) -> Any:
    key: Any
    for key in path:
        if (type(tree) is dict and type(key) is str) or (type(tree) is list and type(key) is int):
            tree = tree[key]  # type: ignore[index]
        else:
            raise TypeError(key)
    return tree


def _set_checked(path: Path, tree: Any, entry: Mapping[str, Any], value: Any) -> Any:
    """Put *value* where *entry*'s key path says, which must lead to a ``null`` in the tree."""
    keys = entry["path"]
    if not keys:
        return value
    try:
        parent, last = _get_path(tree, keys[:-1]), keys[-1]
        if not (
            (type(parent) is dict and type(last) is str and last in parent)
            or (type(parent) is list and type(last) is int and 0 <= last < len(parent))
        ):
            raise TypeError(last)
    except (KeyError, IndexError, TypeError):
        where = key_path(keys)
        raise corrupt(path, DATA, f"has no key {where!r} for an array or big int") from None
    parent[last] = value  # type: ignore[index]
    return tree


def _state_document(path: Path, data: bytes | bytearray) -> tuple[Any, Any, Any]:
    document = parse_json(path, DATA, data)
    if not isinstance(document, dict) or document.get("format") != f"{FORMAT}-state":
        raise corrupt(path, DATA, "is not a checkpoint state (key format)")
    tree: Any = document.get("tree")
    index: Any = document.get("arrays")
    ints: Any = document.get("ints")
    _check_index(path, index, ints)
    return tree, index, ints


_Signed = tuple[bytes, dict[str, str]] | None


def _signature(path: Path) -> _Signed:
    """The key and *path*'s signature when ``EPOCHAL_CHECKPOINT_KEY`` is set (None: unsigned reads)."""
    key = sign.signing_key()
    return None if key is None else (key, sign.read_signature(path))


def _manifest_check(path: Path, signed: _Signed) -> Callable[[bytearray], None] | None:
    if signed is None:
        return None
    key, signature = signed
    return lambda data: sign.check_file(path, MANIFEST, data, key, signature)


def _only_model(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in entries if e["path"][:1] == ["model"]]


def _read_data(
    path: Path,
    expected: Mapping[str, Any],
    model_only: bool,
    signed: _Signed = None,
    into: Any = None,
    fills: list[Fills] | None = None,
) -> Any:
    """The state tree of ``data.bin``: the JSON state (checked against the manifest's CRC-32) and
    then its arrays (all, or the model's), read into one buffer and each checked against its
    own CRC-32 on the way (see :func:`_read_records`). With *signed* (key, signature), the
    whole file is checked against its signature first. Arrays with a destination in *into*
    are verified and left to the :class:`Fills` appended to *fills*."""
    fd, size = open_regular(path, DATA, MAX_FILE_BYTES, expected["size"])
    try:
        if signed is not None:
            sign.check_stream(path, DATA, fd, size, *signed)
        at = expected["state"]
        state = bytearray(size - at)
        crc = read_into(path, DATA, fd, memoryview(state), at)
        if f"{crc:08x}" != expected["crc32"]:
            why = f"state fails its checksum (crc32 {crc:08x}, manifest {expected['crc32']})"
            raise corrupt(path, DATA, why)
        tree, index, ints = _state_document(path, state)
        del state
        if model_only:
            index, ints = _only_model(index), _only_model(ints)
        queue = Fills(path, fd) if into is not None and fills is not None else None
        if queue is not None and fills is not None:
            fills.append(queue)
        for entry, array in zip(index, _read_records(path, fd, index, at, into, queue), strict=True):
            tree = _set_checked(path, tree, entry, array[()] if entry["kind"] == "scalar" else array)
    finally:
        os.close(fd)
    for entry in ints:
        tree = _set_checked(path, tree, entry, int(entry["hex"], 16))
    return tree


def read_checkpoint_info(path: Path, model_only: bool = False, into: Any = None) -> ReadCheckpoint:
    """Read and verify the checkpoint at *path*, as :func:`read_checkpoint`; also return its segments.

    *into*: destinations for the arrays (the module's docstring); each array with one is read
    into it after everything else verified, and the state holds that destination.

    :raises ForeignCheckpointError: *path* is not an epochal checkpoint.
    :raises CorruptCheckpointError: a file is missing, truncated, fails its checksum or holds
        values of the wrong type.
    :raises UnsafeCheckpointError: an array holds a pickle payload (object dtype).
    """
    path = Path(path)
    if not path.is_dir():
        if not path.exists():
            raise CheckpointNotFoundError(f"no checkpoint at {str(path)!r}")
        raise foreign_file_error(path)
    signed = _signature(path)
    manifest = read_manifest(path, _manifest_check(path, signed))
    fills: list[Fills] = []
    try:
        read = _read_verified(path, manifest, model_only, signed, into, fills)
        for fill in fills:  # everything verified: the arrays land in their destinations
            fill.run()
    finally:
        for fill in fills:
            fill.close()
    return read


def _read_verified(
    path: Path, manifest: dict[str, Any], model_only: bool, signed: _Signed, into: Any, fills: list[Fills]
) -> ReadCheckpoint:
    shards = manifest.get(sharded.SHARDED, [])
    tree = _read_data(path, manifest["files"][DATA], model_only, signed, into, fills)
    if not isinstance(tree, dict):
        raise corrupt(path, DATA, "key tree is not a table (the state is a dict)")
    model = tree.get("model")
    if isinstance(model, dict) and (planted := sorted(SHARD_KEYS & model.keys())):
        # where a model reads DCP files from comes from the manifest only, and is this checkpoint
        why = f"key model.{planted[0]} is set; only a reader sets it (to the checkpoint itself)"
        raise corrupt(path, DATA, why)
    if shards:  # every rank's DCP files verified here, before any rank loads them
        sharded.verify(path, shards, manifest["files"], signed)
        if not isinstance(model, dict):
            raise corrupt(path, DATA, "key model is not a table (a sharded checkpoint's model rest)")
        model["dcp"] = str(path.absolute())
        if model_only:  # the module's tensors only: the optimizer's stay as they are
            model["dcp_only"] = "model"
    check = None
    if signed is not None:
        key, signature = signed

        def check(name: str, data: bytearray) -> None:
            sign.check_file(path, name, data, key, signature)

    segments, inline, damaged = ([], [], []) if model_only else read_segments(path, manifest, tree, check)
    if signed is not None:
        for segment in segments:  # a later save that links it signs it without reading it again
            segment.mac = signed[1].get(segment.name)
    return ReadCheckpoint(path, manifest, segments, inline, tree, damaged)


def read_checkpoint(
    path: Path, model_only: bool = False, into: Any = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Read and verify the checkpoint at *path*; return ``(state, manifest)``.

    Every file is checked against the manifest's size and CRC-32 before it is parsed; arrays
    are read without pickle. With *model_only* only ``state["model"]`` is built (the other
    arrays and the log segments are skipped). *into*: destinations for the arrays
    (:func:`read_checkpoint_info`).

    :raises ForeignCheckpointError: *path* is not an epochal checkpoint.
    :raises CorruptCheckpointError: a file is missing, truncated, fails its checksum or holds
        values of the wrong type (naming the file and key).
    :raises UnsafeCheckpointError: an array holds a pickle payload (object dtype).
    """
    info = read_checkpoint_info(path, model_only, into)
    return info.state, info.manifest


def read_state_document(path: Path) -> dict[str, Any]:
    """The JSON state document of checkpoint *path* as written (the tree with ``null`` where
    arrays sit, the array index), checked against the manifest's checksum; for tools and tests
    that look inside."""
    path = Path(path)
    signed = _signature(path)
    entry = read_manifest(path, _manifest_check(path, signed))["files"][DATA]
    whole = read_regular(path, DATA, MAX_FILE_BYTES, entry["size"])
    if signed is not None:
        sign.check_file(path, DATA, whole, *signed)
    data = whole[entry["state"] :]
    if f"{crc32(data):08x}" != entry["crc32"]:
        raise corrupt(path, DATA, "state fails its checksum")
    document = parse_json(path, DATA, data)
    if not isinstance(document, dict):
        raise corrupt(path, DATA, "is not a checkpoint state (key format)")
    return document


def warn_damaged_segments(read: ReadCheckpoint, stacklevel: int = 3) -> None:
    """Warn once for the log segments of *read* that failed verification, naming the rows lost,
    and once for each taken from another checkpoint (nothing lost)."""
    for name, why in read.damaged:
        match = re.match(r"^log-\d+-i(\d+)-(\d+)\.json$", name)
        rows = f"rows {int(match[1])}..{int(match[2])}" if match else "its rows"
        warnings.warn(
            f"{why}; the training log's {rows} held by it are lost (model, optimizer, RNG and "
            "plugin state are intact and are used)",
            RuntimeWarning,
            stacklevel=stacklevel,
        )
    for segment in read.segments or []:
        if segment.origin is not None:
            warnings.warn(
                f"checkpoint {str(read.path)!r}: log segment {segment.name} is missing or damaged; "
                f"its intact copy in {segment.origin.name} (same size and CRC-32) is used",
                RuntimeWarning,
                stacklevel=stacklevel,
            )


def find_latest(
    directory: Path, model_only: bool = False, into: Any = None
) -> tuple[ReadCheckpoint, list[tuple[Path, str]]]:
    """Read the newest complete checkpoint of *directory* that verifies, as :func:`load_latest`.

    *into*: destinations for the arrays (:func:`read_checkpoint_info`): only the checkpoint
    that verifies is read into them.

    Return it and the newer checkpoints that failed verification, with why.
    """
    infos, ignored = list_checkpoints(directory)
    return newest_that_verifies(
        infos,
        ignored,
        str(directory),
        lambda info: read_checkpoint_info(info.path, model_only=model_only, into=into),
    )


def newest_that_verifies(
    infos: list[CheckpointInfo],
    ignored: list[tuple[str, str]],
    where: str,
    read: Callable[[CheckpointInfo], ReadCheckpoint],
) -> tuple[ReadCheckpoint, list[tuple[Path, str]]]:
    """The newest of *infos* (complete checkpoints of *where*, in save order) that *read* reads
    and verifies, and the newer ones that failed, with why: a local directory's or a store's.

    :raises CheckpointNotFoundError: no complete checkpoint (*ignored* are named).
    :raises CorruptCheckpointError: every one failed (:class:`UnsafeCheckpointError` when one
        held a pickle payload).
    """
    if not infos:
        extra = f"; ignored: {'; '.join(f'{n} ({why})' for n, why in ignored)}" if ignored else ""
        raise CheckpointNotFoundError(f"no complete checkpoint in {where!r}{extra}")
    for name, why in ignored:
        warnings.warn(f"ignoring {name} in {where!r}: {why}", RuntimeWarning, stacklevel=4)
    failures: list[tuple[Path, str]] = []
    unsafe = False
    for info in reversed(infos):
        try:
            found = read(info)
        except (CorruptCheckpointError, UnsafeCheckpointError, ForeignCheckpointError) as error:
            unsafe = unsafe or isinstance(error, UnsafeCheckpointError)
            failures.append((info.path, str(error)))
            warnings.warn(f"{error}; trying the previous checkpoint", RuntimeWarning, stacklevel=4)
            continue
        warn_damaged_segments(found, stacklevel=5)
        return found, failures
    kind = UnsafeCheckpointError if unsafe else CorruptCheckpointError
    raise kind(f"every checkpoint in {where!r} is corrupt: " + "; ".join(why for _, why in failures))


def load_latest(directory: Path, model_only: bool = False) -> tuple[dict[str, Any], CheckpointInfo]:
    """Read the newest complete checkpoint of *directory* that verifies.

    A damaged checkpoint is reported with one :class:`RuntimeWarning` naming the file and why,
    and the one before it is tried, and so on. A damaged log segment costs only its rows (a
    warning names them); the rest of that checkpoint is used.

    :raises CheckpointNotFoundError: when *directory* holds no complete checkpoint.
    :raises CorruptCheckpointError: when every checkpoint fails verification (a checkpoint
        holding a pickle payload counts as failing it, with a warning saying so).
    :raises UnsafeCheckpointError: when every checkpoint fails and one held a pickle payload.
    """
    read, _ = find_latest(directory, model_only)
    return read.state, CheckpointInfo(read.path, read.manifest, read.segments, read.inline_rows)
