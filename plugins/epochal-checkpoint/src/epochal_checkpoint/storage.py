"""The on-disk checkpoint format: atomic writes, checksums, no pickle.

A checkpoint is a directory ``ckpt-e<epoch>-i<iteration>`` (``-v2``, ``-v3``... when the name is
taken) holding three files, plus the training log's segments:

``arrays.npy``
    every numpy array of the state, one ``.npy`` record after another (numpy's own format:
    header + raw buffer, read back with ``allow_pickle=False``; ``np.load`` called repeatedly
    on the open file reads them in order).
``state.json``
    everything else as JSON, with ``null`` where an array sits, and an index giving each
    array's key path, offset, dtype and shape.
``log-<sequence>-i<first>-<last>.json``
    the training log's rows (``state["log"]["rows"]``), in segments: JSON ``{"<iteration>":
    {key: value}}``, read in the manifest's ``log_segments`` order, a later segment's row
    replacing an earlier one's (``{}``: the row was emptied). A segment is immutable: the next
    checkpoint of the run hard-links the previous one's segments (a copy when linking fails) and
    writes one new segment with only the rows new or changed since, so a save costs what
    changed, not the whole history; each checkpoint directory still holds every byte it needs.
    Rows that cannot be written as plain JSON (nested numpy values, huge ints) stay in
    ``state.json``, which is read last.
``manifest.json``
    written last: format, run id, lineage, epoch, iteration, time, plugin set, the monitored
    metric, the segment order, and the size and CRC-32 of every other file.

Writing: the files go into a temporary directory beside the target (``<name>.epochal-tmp-<hex>``),
each is fsynced, the directory is renamed into place and its parent fsynced. A reader therefore
sees a complete checkpoint or none; leftovers carry the temporary suffix and only those are
ever cleaned up. Deleting a checkpoint renames it to a temporary name first, so a crash in the
middle of a deletion leaves no half checkpoint under a final name either.
"""

from __future__ import annotations

import datetime
import io
import json
import math
import os
import re
import shutil
import sys
import threading
import time
import uuid
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from epochal_checkpoint.errors import (
    CheckpointNotFoundError,
    CheckpointWriteError,
    CorruptCheckpointError,
    ForeignCheckpointError,
    UnsafeCheckpointError,
    UnsupportedStateError,
)

if TYPE_CHECKING:
    import numpy as np

FORMAT = "epochal-checkpoint"
FORMAT_VERSION = 2
#: the format versions this module reads (1: no log segments).
READ_VERSIONS = (1, 2)
LOG_FORMAT = f"{FORMAT}-log"
SEGMENTS = "log_segments"
SEGMENT_RE = re.compile(r"^log-\d+-i\d+-\d+\.json$")
MANIFEST = "manifest.json"
STATE = "state.json"
ARRAYS = "arrays.npy"
POINTER = "latest"
DATA_FILES = (ARRAYS, STATE)
TMP_MARK = ".epochal-tmp-"
TMP_RE = re.compile(r"\.epochal-tmp-[0-9a-f]{32}$")
NAME_RE = re.compile(r"^ckpt-e(\d+)-i(\d+)(?:-v(\d+))?$")
#: above this many bits an int is stored as hex text (Python refuses to parse > 4300 digits).
BIG_INT_BITS = 4000
#: states with more array bytes than this compute their checksum in a second thread.
PARALLEL_CHECKSUM_BYTES = 1 << 22

_SCALARS = (str, bool, float, type(None))
PathKey = str | int


def checkpoint_name(epoch: int, iteration: int) -> str:
    """The directory name of a checkpoint taken after *epoch* epochs and *iteration* batches."""
    return f"ckpt-e{epoch:04d}-i{iteration:06d}"


def temp_name(name: str) -> str:
    """A fresh temporary name for *name* carrying the suffix only this plugin uses."""
    return f"{name}{TMP_MARK}{uuid.uuid4().hex}"


def segment_name(sequence: int, rows: Iterable[int]) -> str:
    """The file name of a log segment written by save *sequence* holding rows *rows*."""
    ids = list(rows)
    return f"log-{sequence:06d}-i{min(ids, default=0):06d}-{max(ids, default=0):06d}.json"


def key_path(path: Sequence[PathKey]) -> str:
    """``("plugins", "monitor", "state", "foo", 3)`` → ``plugins.monitor.state.foo[3]``."""
    text = ""
    for key in path:
        text += f"[{key}]" if isinstance(key, int) else (f".{key}" if text else str(key))
    return text or "<root>"


# -- flattening a state into JSON + arrays ----------------------------------------------------


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
    already touched is 2x faster than into fresh pages. Tuples become lists.

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
        if copy_arrays:
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


@dataclass
class Segment:
    """A log segment file of a checkpoint: name, size, CRC-32 and the iterations of its rows."""

    name: str
    size: int
    crc32: str
    rows: list[int]


@dataclass
class NewSegment:
    """A log segment to write: its name and the rows (a JSON-able tree from :func:`flatten`)."""

    name: str
    rows: dict[str, Any]


@dataclass
class LinkedSegment:
    """A segment of the checkpoint *source* to hard-link (or copy) into a new checkpoint."""

    source: Path
    segment: Segment


def encode_segment(rows: Mapping[str, Any]) -> bytes:
    """The bytes of a log segment holding *rows* (``{"<iteration>": {key: value}}``)."""
    document = {"format": LOG_FORMAT, "version": 1, "rows": rows}
    return json.dumps(document, separators=(",", ":"), allow_nan=True).encode("ascii")


def _set_path(tree: Any, path: Sequence[PathKey], value: Any) -> Any:
    if not path:
        return value
    target = tree
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return tree


# -- writing ------------------------------------------------------------------------------------


def _npy_header(array: np.ndarray) -> bytes:
    import numpy as np

    header = np.lib.format.header_data_from_array_1_0(array)
    buffer = io.BytesIO()
    try:
        np.lib.format.write_array_header_1_0(buffer, header)
    except ValueError:  # a header longer than 64 KiB (huge structured dtypes)
        buffer = io.BytesIO()
        np.lib.format.write_array_header_2_0(buffer, header)
    return buffer.getvalue()


def _raw(array: np.ndarray) -> memoryview:
    import numpy as np

    raw: Any = array.reshape(-1).view(np.uint8)
    return memoryview(raw)


def _write_all(fd: int, data: memoryview | bytes) -> None:
    view = memoryview(data)
    while view.nbytes:
        written = os.write(fd, view)
        view = view[written:]


def _crc(pieces: Iterable[memoryview | bytes]) -> int:
    crc = 0
    for piece in pieces:
        crc = zlib.crc32(piece, crc)
    return crc


def _write_file(path: Path, pieces: Sequence[memoryview | bytes], parallel: bool) -> dict[str, Any]:
    """Write *pieces* to *path*, fsync it, and return its size and CRC-32.

    With *parallel* the checksum is computed while a second thread waits for the fsync (both
    release the GIL): measured, that hides the checksum almost entirely, where computing it
    during the writes competed with them for memory bandwidth.
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        for piece in pieces:
            _write_all(fd, piece)
        if parallel:
            failure: list[OSError] = []

            def sync() -> None:
                try:
                    os.fsync(fd)
                except OSError as error:
                    failure.append(error)

            worker = threading.Thread(target=sync, daemon=True)
            worker.start()
            try:
                crc = _crc(pieces)
            finally:
                worker.join()
            if failure:
                raise failure[0]
        else:
            os.fsync(fd)
            crc = _crc(pieces)
    finally:
        os.close(fd)
    return {"size": sum(memoryview(p).nbytes for p in pieces), "crc32": f"{crc:08x}"}


def fsync_dir(path: Path) -> None:
    """Make a rename or deletion inside directory *path* durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def encode(snapshot: Snapshot) -> tuple[list[memoryview | bytes], bytes]:
    """The pieces of ``arrays.npy`` and the bytes of ``state.json`` for *snapshot*."""
    pieces: list[memoryview | bytes] = []
    offset = 0
    for entry, array in zip(snapshot.index, snapshot.arrays):
        header, raw = _npy_header(array), _raw(array)
        entry["offset"] = offset
        offset += len(header) + raw.nbytes
        pieces += [header, raw]
    document = {
        "format": f"{FORMAT}-state",
        "version": FORMAT_VERSION,
        "tree": snapshot.tree,
        "arrays": snapshot.index,
        "ints": snapshot.ints,
    }
    text = json.dumps(document, separators=(",", ":"), allow_nan=True)
    return pieces, text.encode("ascii")


def _add_segment(tmp: Path, source: LinkedSegment | NewSegment) -> Segment:
    """Put a log segment into the temporary checkpoint directory *tmp*; return what it is."""
    if isinstance(source, NewSegment):
        rows = [int(i) for i in source.rows]
        written = _write_file(tmp / source.name, [encode_segment(source.rows)], False)
        return Segment(source.name, written["size"], written["crc32"], rows)
    segment, origin, target = source.segment, source.source / source.segment.name, tmp / source.segment.name
    try:
        os.link(origin, target)  # its bytes were fsynced when first written; the checksum is reused
    except FileNotFoundError:
        raise
    except OSError:  # no hard links here (or too many): copy it, verifying it on the way
        try:
            data = _read_verified(source.source, segment.name, {"size": segment.size, "crc32": segment.crc32})
        except CorruptCheckpointError as error:
            raise CheckpointWriteError(f"cannot reuse a log segment: {error}") from None
        _write_file(target, [data], False)
        return segment
    size = os.stat(target).st_size
    if size != segment.size:
        raise CheckpointWriteError(
            f"cannot reuse log segment {str(origin)!r}: it has {size} bytes, {segment.size} were written"
        )
    return segment


def write_checkpoint(
    directory: Path,
    name: str,
    snapshot: Snapshot,
    manifest: Mapping[str, Any],
    pointer: bool = True,
    segments: Sequence[LinkedSegment | NewSegment] = (),
) -> CheckpointInfo:
    """Write *snapshot* atomically as checkpoint *name* in *directory*; return where and what.

    When *name* is taken (a checkpoint of another run at the same counters), ``-v2``, ``-v3``...
    is appended; an existing checkpoint is never overwritten. With *pointer*, ``latest`` is
    replaced atomically to name the new checkpoint, in the same directory sync as its rename.

    The arrays file is written (and fsynced) in a second thread while this one writes the JSON
    state, the log *segments* (in this order: linked from an earlier checkpoint, or new) and the
    pointer's temporary file, so the small files' syncs overlap the big one.

    :raises CheckpointWriteError: naming the path, when the disk is full, permission is denied
        or any other OS error occurs; the temporary directory is removed and every earlier
        checkpoint is left as it was.
    """
    names = [s.segment.name if isinstance(s, LinkedSegment) else s.name for s in segments]
    if len(set(names)) != len(names) or not all(SEGMENT_RE.match(n) for n in names):
        raise ValueError(f"log segment names must be unique and match {SEGMENT_RE.pattern}: {names}")
    tmp = directory / temp_name(name)
    pointer_tmp = directory / temp_name(POINTER) if pointer else None
    current = tmp
    worker = None
    try:
        tmp.mkdir()
        final_name = unique_name(directory, name)
        pieces, state_bytes = encode(snapshot)
        files: dict[str, Any] = {}
        failure: list[BaseException] = []
        parallel = snapshot.nbytes >= PARALLEL_CHECKSUM_BYTES

        def write_arrays() -> None:
            try:
                files[ARRAYS] = _write_file(tmp / ARRAYS, pieces, parallel)
            except BaseException as error:
                failure.append(error)

        if parallel:
            worker = threading.Thread(target=write_arrays, daemon=True)
            worker.start()
        else:
            write_arrays()
        files[STATE] = _write_file(tmp / STATE, [state_bytes], False)
        written = [_add_segment(tmp, source) for source in segments]
        for segment in written:
            files[segment.name] = {"size": segment.size, "crc32": segment.crc32}
        if pointer_tmp is not None:
            current = pointer_tmp
            _write_file(pointer_tmp, [(final_name + "\n").encode("utf-8")], False)
        if worker is not None:
            worker.join()
            worker = None
        if failure:
            raise failure[0]
        now = time.time_ns()
        document = {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "name": final_name,
            **manifest,
            "saved_at": datetime.datetime.fromtimestamp(now / 1e9, datetime.UTC).isoformat(),
            "saved_at_ns": now,
            **({SEGMENTS: [segment.name for segment in written]} if written else {}),
            "files": {ARRAYS: files[ARRAYS], STATE: files[STATE], **{s.name: files[s.name] for s in written}},
        }
        current = tmp / MANIFEST
        _write_file(current, [json.dumps(document, indent=1).encode("ascii")], False)
        current = tmp
        fsync_dir(tmp)
        final = directory / final_name
        current = final
        os.rename(tmp, final)
        if pointer_tmp is not None:
            current = directory / POINTER
            os.replace(pointer_tmp, current)
        current = directory
        fsync_dir(directory)
        return CheckpointInfo(final, document, written)
    except BaseException as error:
        if worker is not None:
            worker.join()
        shutil.rmtree(tmp, ignore_errors=True)
        if pointer_tmp is not None:
            pointer_tmp.unlink(missing_ok=True)
        if not isinstance(error, OSError):
            raise
        where = error.filename or current
        raise CheckpointWriteError(
            f"cannot write checkpoint {str(directory / name)!r}: {error.strerror or error} "
            f"({where}); earlier checkpoints are kept"
        ) from error


def unique_name(directory: Path, name: str) -> str:
    """*name*, or *name* with the first free ``-vN`` suffix."""
    candidate, version = name, 1
    while (directory / candidate).exists():
        version += 1
        candidate = f"{name}-v{version}"
    return candidate


def write_pointer(directory: Path, name: str) -> None:
    """Point ``<directory>/latest`` at checkpoint *name* atomically (temp file, fsync, replace)."""
    tmp = directory / temp_name(POINTER)
    try:
        _write_file(tmp, [(name + "\n").encode("utf-8")], False)
        os.replace(tmp, directory / POINTER)
        fsync_dir(directory)
    except OSError as error:
        tmp.unlink(missing_ok=True)
        raise CheckpointWriteError(
            f"cannot update {str(directory / POINTER)!r}: {error.strerror or error}"
        ) from error


def read_pointer(directory: Path) -> str | None:
    """The checkpoint name ``<directory>/latest`` points at (None if absent or unreadable)."""
    try:
        return (directory / POINTER).read_text(encoding="utf-8").strip() or None
    except (OSError, UnicodeDecodeError):
        return None


def delete_checkpoint(path: Path) -> None:
    """Remove a checkpoint: rename it to a temporary name (atomic), then delete that."""
    doomed = path.parent / temp_name(path.name)
    os.rename(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def clean_temporaries(directory: Path) -> list[str]:
    """Delete the leftovers of interrupted writes and deletions (only names with our suffix)."""
    removed: list[str] = []
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return removed
    for entry in entries:
        if TMP_RE.search(entry.name):
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path, ignore_errors=True)
            else:
                Path(entry.path).unlink(missing_ok=True)
            removed.append(entry.name)
    return removed


# -- reading ------------------------------------------------------------------------------------


@dataclass
class CheckpointInfo:
    """A complete checkpoint found in a directory (its manifest read, files not yet verified)."""

    path: Path
    manifest: dict[str, Any]
    #: its log segments, once written or read (None: not read yet).
    segments: list[Segment] | None = None
    #: the log rows kept in ``state.json`` rather than in segments, once read.
    inline_rows: list[int] = field(default_factory=list)

    @property
    def name(self) -> str:
        """The checkpoint's directory name."""
        return self.path.name

    @property
    def order(self) -> tuple[int, int]:
        """Sort key: save sequence, then save time."""
        return int(self.manifest.get("sequence", 0)), int(self.manifest.get("saved_at_ns", 0))


def read_manifest(path: Path) -> dict[str, Any]:
    """Read and check ``<path>/manifest.json``.

    :raises ForeignCheckpointError: if *path* has no manifest or it is not ours.
    :raises CorruptCheckpointError: if the manifest is unreadable.
    """
    file = path / MANIFEST
    try:
        text = file.read_bytes()
    except FileNotFoundError:
        raise ForeignCheckpointError(
            f"{str(path)!r} is not an epochal checkpoint (no {MANIFEST}; an incomplete or foreign directory)"
        ) from None
    except OSError as error:
        raise CorruptCheckpointError(f"cannot read {str(file)!r}: {error.strerror or error}") from None
    try:
        manifest = json.loads(text)
    except (ValueError, UnicodeDecodeError) as error:
        raise CorruptCheckpointError(
            f"checkpoint {str(path)!r}: {MANIFEST} is not valid JSON ({error})"
        ) from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ForeignCheckpointError(
            f"{str(path)!r} is not an epochal checkpoint ({MANIFEST} of another format)"
        )
    if manifest.get("version") not in READ_VERSIONS:
        raise ForeignCheckpointError(
            f"checkpoint {str(path)!r} has format version {manifest.get('version')!r}; this "
            f"epochal-checkpoint reads versions {', '.join(map(str, READ_VERSIONS))} "
            "(upgrade epochal-checkpoint)"
        )
    files = manifest.get("files")
    segments = manifest.get(SEGMENTS, [])
    if (
        not isinstance(segments, list)
        or not all(isinstance(n, str) and SEGMENT_RE.match(n) for n in segments)
        or len(set(segments)) != len(segments)
    ):
        raise CorruptCheckpointError(f"checkpoint {str(path)!r}: {MANIFEST} has a bad {SEGMENTS} list")
    expected = {*DATA_FILES, *segments}
    if not isinstance(files, dict) or set(files) != expected:
        listed = sorted(files) if isinstance(files, dict) else files
        raise CorruptCheckpointError(
            f"checkpoint {str(path)!r}: {MANIFEST} lists files {listed!r}, expected {sorted(expected)}"
        )
    return manifest


def list_checkpoints(directory: Path) -> tuple[list[CheckpointInfo], list[tuple[str, str]]]:
    """The complete checkpoints in *directory*, oldest first, and the ignored entries with why.

    A checkpoint counts as complete when its directory has its final name and a manifest of
    this format; its files are verified when it is read.
    """
    found: list[CheckpointInfo] = []
    ignored: list[tuple[str, str]] = []
    try:
        entries = sorted(os.scandir(directory), key=lambda e: e.name)
    except FileNotFoundError:
        return found, ignored
    except OSError as error:
        raise CheckpointNotFoundError(
            f"cannot list checkpoint directory {str(directory)!r}: {error.strerror or error}"
        ) from None
    for entry in entries:
        if not NAME_RE.match(entry.name) or not entry.is_dir():
            continue
        try:
            found.append(CheckpointInfo(Path(entry.path), read_manifest(Path(entry.path))))
        except (ForeignCheckpointError, CorruptCheckpointError) as error:
            ignored.append((entry.name, str(error)))
    found.sort(key=lambda info: info.order)
    return found, ignored


def _read_verified(path: Path, name: str, expected: Mapping[str, Any]) -> bytes:
    file = path / name
    try:
        data = file.read_bytes()
    except FileNotFoundError:
        raise CorruptCheckpointError(f"checkpoint {str(path)!r}: {name} is missing") from None
    except OSError as error:
        raise CorruptCheckpointError(f"cannot read {str(file)!r}: {error.strerror or error}") from None
    if len(data) != expected.get("size"):
        raise CorruptCheckpointError(
            f"checkpoint {str(path)!r}: {name} has {len(data)} bytes, the manifest says "
            f"{expected.get('size')} (truncated or overwritten)"
        )
    crc = f"{zlib.crc32(data):08x}"
    if crc != expected.get("crc32"):
        raise CorruptCheckpointError(
            f"checkpoint {str(path)!r}: {name} fails its checksum (crc32 {crc}, manifest "
            f"{expected.get('crc32')})"
        )
    return data


def read_checkpoint(path: Path, model_only: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
    """Read and verify the checkpoint at *path*; return ``(state, manifest)``.

    Every file is checked against the manifest's size and CRC-32 before it is parsed; arrays
    are read with ``allow_pickle=False``. With *model_only* only ``state["model"]`` is built
    (the other arrays and the log segments are skipped).

    :raises ForeignCheckpointError: *path* is not an epochal checkpoint.
    :raises CorruptCheckpointError: a file is missing, truncated, or fails its checksum.
    :raises UnsafeCheckpointError: an array holds a pickle payload (object dtype).
    """
    info = read_checkpoint_info(path, model_only)
    return info.state, info.manifest


@dataclass
class ReadCheckpoint(CheckpointInfo):
    """A checkpoint read and verified: :class:`CheckpointInfo` and its state."""

    state: dict[str, Any] = field(default_factory=dict)


def _read_segments(
    path: Path, manifest: Mapping[str, Any], tree: dict[str, Any]
) -> tuple[list[Segment], list[int]]:
    """Read the log segments of *manifest* into ``tree["log"]["rows"]`` (rows in iteration order).

    Return the segments and the rows found in ``state.json``.
    """
    names = manifest.get(SEGMENTS, [])
    if not names:
        return [], []
    log: Any = tree.get("log")
    inline = log.get("rows") if isinstance(log, dict) else None
    if not isinstance(inline, dict):
        raise CorruptCheckpointError(f"checkpoint {str(path)!r}: {STATE} has no log rows to complete")
    merged: dict[str, Any] = {}
    segments = []
    for name in names:
        expected = manifest["files"][name]
        data = _read_verified(path, name, expected)
        try:
            document = json.loads(data)
            rows = document["rows"]
            if document.get("format") != LOG_FORMAT or not isinstance(rows, dict):
                raise ValueError(f"format {document.get('format')!r}")
            ids = [int(i) for i in rows]
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            raise CorruptCheckpointError(
                f"checkpoint {str(path)!r}: {name} is not a valid log segment ({error})"
            ) from None
        segments.append(Segment(name, expected["size"], expected["crc32"], ids))
        merged.update(rows)
    merged.update(inline)
    try:
        inline_rows = [int(i) for i in inline]
        order = sorted(merged, key=int)
    except ValueError as error:
        raise CorruptCheckpointError(
            f"checkpoint {str(path)!r}: a log row key is not an int ({error})"
        ) from None
    log["rows"] = {i: merged[i] for i in order if merged[i]}
    return segments, inline_rows


def read_checkpoint_info(path: Path, model_only: bool = False) -> ReadCheckpoint:
    """Read and verify the checkpoint at *path*, as :func:`read_checkpoint`; also return its segments.

    :raises ForeignCheckpointError: *path* is not an epochal checkpoint.
    :raises CorruptCheckpointError: a file is missing, truncated, or fails its checksum.
    :raises UnsafeCheckpointError: an array holds a pickle payload (object dtype).
    """
    import numpy as np

    path = Path(path)
    if not path.is_dir():
        if not path.exists():
            raise CheckpointNotFoundError(f"no checkpoint at {str(path)!r}")
        raise foreign_file_error(path)
    manifest = read_manifest(path)
    files = manifest["files"]
    state_bytes = _read_verified(path, STATE, files[STATE])
    try:
        document = json.loads(state_bytes)
        tree, index, ints = document["tree"], document["arrays"], document["ints"]
        if document.get("format") != f"{FORMAT}-state":
            raise ValueError(f"format {document.get('format')!r}")
    except (ValueError, KeyError, TypeError) as error:
        raise CorruptCheckpointError(
            f"checkpoint {str(path)!r}: {STATE} is not a valid state ({error})"
        ) from None
    if model_only:
        index = [e for e in index if e["path"][:1] == ["model"]]
        ints = [e for e in ints if e["path"][:1] == ["model"]]
    arrays = _read_verified(path, ARRAYS, files[ARRAYS]) if index else b""
    stream = io.BytesIO(arrays)
    for entry in index:
        where = f"checkpoint {str(path)!r}: {ARRAYS} array {key_path(entry['path'])!r}"
        try:
            stream.seek(entry["offset"])
            array = np.lib.format.read_array(stream, allow_pickle=False)
        except ValueError as error:
            if "pickle" in str(error):
                raise UnsafeCheckpointError(
                    f"{where} holds a pickle payload (object dtype); epochal never unpickles "
                    "checkpoint data, refusing to load it"
                ) from None
            raise CorruptCheckpointError(f"{where} cannot be read: {error}") from None
        except (OSError, EOFError, KeyError, TypeError) as error:
            raise CorruptCheckpointError(f"{where} cannot be read: {error}") from None
        if array.dtype.str != entry["dtype"] or list(array.shape) != entry["shape"]:
            raise CorruptCheckpointError(
                f"{where} is {array.dtype.str} {list(array.shape)}, the index says "
                f"{entry['dtype']} {entry['shape']}"
            )
        try:
            tree = _set_path(tree, entry["path"], array[()] if entry["kind"] == "scalar" else array)
        except (KeyError, IndexError, TypeError):
            raise CorruptCheckpointError(f"{where}: its key path is not in {STATE}") from None
    for entry in ints:
        tree = _set_path(tree, entry["path"], int(entry["hex"], 16))
    if not isinstance(tree, dict):
        raise CorruptCheckpointError(f"checkpoint {str(path)!r}: the state is not a dict")
    segments, inline = ([], []) if model_only else _read_segments(path, manifest, tree)
    return ReadCheckpoint(path, manifest, segments, inline, tree)


def foreign_file_error(path: Path) -> ForeignCheckpointError | UnsafeCheckpointError:
    """The error for a file given where a checkpoint directory was expected (pickles named so)."""
    try:
        with open(path, "rb") as file:
            head = file.read(8)
    except OSError as error:
        return ForeignCheckpointError(f"cannot read {str(path)!r}: {error.strerror or error}")
    if len(head) > 1 and head[0] == 0x80 and 2 <= head[1] <= 5:
        return UnsafeCheckpointError(
            f"{str(path)!r} is a pickle file (pickle/torch.save); epochal never unpickles "
            "checkpoints, refusing to load it"
        )
    if head.startswith(b"PK"):
        return ForeignCheckpointError(
            f"{str(path)!r} is a zip archive (.npz/torch.save), not an epochal checkpoint; "
            f"epochal checkpoints are directories holding {MANIFEST}"
        )
    return ForeignCheckpointError(
        f"{str(path)!r} is a file, not an epochal checkpoint (a directory holding {MANIFEST})"
    )


def is_finite_number(value: Any) -> bool:
    """Whether *value* is a real, finite number (a usable metric)."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        return False
    return not isinstance(value, bool) and math.isfinite(number)


def load_latest(directory: Path, model_only: bool = False) -> tuple[dict[str, Any], CheckpointInfo]:
    """Read the newest complete checkpoint of *directory* that verifies.

    A corrupt newest checkpoint is reported with a :class:`RuntimeWarning` and the one before it
    is tried, and so on.

    :raises CheckpointNotFoundError: when *directory* holds no complete checkpoint.
    :raises CorruptCheckpointError: when every checkpoint fails verification.
    :raises UnsafeCheckpointError: when the newest readable one holds a pickle payload.
    """
    import warnings

    infos, ignored = list_checkpoints(directory)
    if not infos:
        extra = f"; ignored: {'; '.join(f'{n} ({why})' for n, why in ignored)}" if ignored else ""
        raise CheckpointNotFoundError(f"no complete checkpoint in {str(directory)!r}{extra}")
    for name, why in ignored:
        warnings.warn(f"ignoring {name} in {str(directory)!r}: {why}", RuntimeWarning, stacklevel=2)
    failures = []
    for info in reversed(infos):
        try:
            read = read_checkpoint_info(info.path, model_only=model_only)
        except CorruptCheckpointError as error:
            failures.append(str(error))
            warnings.warn(f"{error}; trying the previous checkpoint", RuntimeWarning, stacklevel=2)
            continue
        if failures:
            warnings.warn(
                f"using checkpoint {str(info.path)!r} instead of the newer corrupt one(s)",
                RuntimeWarning,
                stacklevel=2,
            )
        return read.state, CheckpointInfo(info.path, read.manifest, read.segments, read.inline_rows)
    raise CorruptCheckpointError(f"every checkpoint in {str(directory)!r} is corrupt: " + "; ".join(failures))
