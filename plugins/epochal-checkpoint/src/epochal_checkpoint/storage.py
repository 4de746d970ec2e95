"""The on-disk checkpoint format: atomic writes, checksums, no pickle.

A checkpoint is a directory ``ckpt-e<epoch>-i<iteration>`` (``-v2``, ``-v3``... when the name is
taken) holding one data file and a manifest, plus the training log's segments (format 4):

``data.bin``
    every numpy array of the state, one ``.npy`` record after another (numpy's own format:
    header + raw buffer, written straight from the array's memory), then the rest of the state
    as JSON, with ``null`` where an array sits and an index giving each array's key path,
    offset, dtype, shape and CRC-32. A reader checks the state, then reads each array it wants
    (all, or only the model's) into one buffer allocated for them, checksumming each
    array on the way.
``log-<sequence>-i<first>-<last>.json``
    the training log's rows (``state["log"]["rows"]``), in segments: JSON ``{"<iteration>":
    {key: value}}``, read in the manifest's ``log_segments`` order, a later segment's row
    replacing an earlier one's (``{}``: the row was emptied). A segment is immutable: the next
    checkpoint of the run hard-links the previous one's segments (a copy when linking fails) and
    writes one new segment with only the rows new or changed since, so a save costs what
    changed, not the whole history; each checkpoint directory still holds every byte it needs.
    Rows that cannot be written as plain JSON (nested numpy values, huge ints) stay in the
    state, which is read last.
``manifest.json``
    format, run id, lineage, epoch, iteration, save sequence, time, plugin set, the monitored
    metric, the segment order, the checkpoints this run family wrote and keeps (``written``:
    rotation deletes only those), the size of every file and CRC-32 of the state and the
    segments, and last the commit record: the CRC-32 of every byte before its digits. Every
    byte that decides whether a checkpoint is complete and which one is newest is so covered: a
    checkpoint whose manifest does not verify is skipped (with a warning naming the file and
    why), never taken as the newest, and never pruned.
``latest`` (beside the checkpoints)
    a symbolic link holding the newest checkpoint's bare name.

Formats 1-3 (still read) kept the arrays in ``arrays.npy`` and the state in ``state.json``,
each checked whole, format 3's commit record in a file ``commit``, and ``latest`` as a text file.

CRC-32 is computed with zlib-ng (the same values as ``zlib.crc32``, SIMD: ~15x faster).

Reading is bounded (see :func:`read_regular`): sizes are checked against the manifest before
anything is allocated, JSON is capped in size and depth, links, FIFOs and devices are refused
without being opened for reading, and a wrong type anywhere is a :class:`CorruptCheckpointError`
naming the file and key. A damaged log segment costs only the rows it holds.

Writing: the files go into a temporary directory beside the target (``<name>.epochal-tmp-<hex>``),
they and the directory are fsynced together (concurrently: one journal commit), then the
directory is renamed into place and its parent fsynced. A
reader therefore sees a complete checkpoint or none; leftovers carry the temporary suffix and only those are
ever cleaned up. Deleting a checkpoint renames it to a temporary name first, so a crash in the
middle of a deletion leaves no half checkpoint under a final name either.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import json
import math
import os
import re
import shutil
import stat
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
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

try:  # zlib-ng's CRC-32 is zlib's checksum (same values), computed ~15x faster with SIMD
    from zlib_ng.zlib_ng import crc32
except ImportError:  # pragma: no cover - a platform without zlib-ng wheels
    from zlib import crc32

if TYPE_CHECKING:
    import numpy as np

FORMAT = "epochal-checkpoint"
FORMAT_VERSION = 4
#: the format versions this module reads (1: no log segments; 2: no commit record; 3: arrays,
#: state, manifest and commit record in four files).
READ_VERSIONS = (1, 2, 3, 4)
LOG_FORMAT = f"{FORMAT}-log"
SEGMENTS = "log_segments"
SEGMENT_RE = re.compile(r"^log-\d+-i\d+-\d+\.json$")
MANIFEST = "manifest.json"
#: the commit record, written last: the manifest's size and CRC-32 (and its own CRC-32).
COMMIT = "commit"
COMMIT_MAGIC = "epochal-checkpoint-commit 1"
COMMIT_RE = re.compile(rb"^epochal-checkpoint-commit 1 (\d{1,12}) ([0-9a-f]{8}) ([0-9a-f]{8})\n$")
#: the manifest key listing the checkpoints this run family wrote and keeps (rotation's record).
OWN = "written"
STATE = "state.json"
ARRAYS = "arrays.npy"
POINTER = "latest"
#: the data files of versions 1-3.
DATA_FILES = (ARRAYS, STATE)
#: the one data file of version 4: the arrays' ``.npy`` records, then the JSON state.
DATA = "data.bin"
#: version 4's commit record: the manifest's last key, the CRC-32 of every byte before its digits.
SEAL_RE = re.compile(rb'"commit": "([0-9a-f]{8})"\n\}\n\Z')
#: arrays are read (and checksummed while in the cache) in pieces of this many bytes.
READ_CHUNK = 256 << 10
TMP_MARK = ".epochal-tmp-"
TMP_RE = re.compile(r"\.epochal-tmp-[0-9a-f]{32}$")
NAME_RE = re.compile(r"^ckpt-e(\d+)-i(\d+)(?:-v(\d+))?$")
#: above this many bits an int is stored as hex text (Python refuses to parse > 4300 digits).
BIG_INT_BITS = 4000
#: reading limits: a file larger than the manifest says is refused before anything is allocated.
MAX_FILE_BYTES = 1 << 40
MAX_MANIFEST_BYTES = 64 << 20
MAX_COMMIT_BYTES = 128
MAX_POINTER_BYTES = 1024
MAX_JSON_DEPTH = 256
MAX_COUNT = 1 << 62
NPY_HEADER_MAX = (1 << 16) + 16
CRC_RE = re.compile(r"^[0-9a-f]{8}$")
HEX_RE = re.compile(r"^-?0x[0-9a-f]{1,1048576}$")
_ROW_KEY = re.compile(r"^\d{1,18}$")

_SCALARS = (str, bool, float, type(None))
_NUMBERS = frozenset({int, float, bool})
_INT_LIMIT = 1 << BIG_INT_BITS
PathKey = str | int


def _plain_numbers(items: Any) -> bool:
    """Whether *items* holds only ints (none above :data:`BIG_INT_BITS` bits), floats and bools:
    a list saved as it is (a random generator's 625 ints), checked without a call per item."""
    if len(items) < 8 or not set(map(type, items)) <= _NUMBERS:
        return False
    # min and max skip no int: a NaN first makes them NaN, and NaN fails both comparisons
    return min(items) > -_INT_LIMIT and max(items) < _INT_LIMIT


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
            if (kind is list or kind is tuple) and _plain_numbers(value):
                return list(value)  # nothing in it to check or to replace, at C speed
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


@dataclass
class MergedSegment:
    """A new log segment made of earlier segments' bytes and new rows: a merge on disk.

    The *parts* (segments of an earlier checkpoint, in reading order) are read back, verified
    and their rows copied as bytes (no parsing), then *rows* follow; a reader's later-row-wins
    rule gives the same rows as reading the parts and a new segment one after another. A part
    that fails verification is replaced by ``reload(segment)``: its rows from the training log.
    """

    name: str
    parts: list[LinkedSegment]
    rows: dict[str, Any]
    reload: Callable[[Segment], Mapping[str, Any]]


#: every segment starts with these bytes and ends with ``}}`` (see :func:`encode_segment`).
SEGMENT_HEAD = b'{"format":"' + LOG_FORMAT.encode("ascii") + b'","version":1,"rows":{'


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


def _writev_all(fd: int, pieces: Sequence[memoryview | bytes]) -> None:
    """Write *pieces* in order with as few system calls as the kernel allows (no joined copy)."""
    views = [memoryview(piece).cast("B") for piece in pieces if len(piece)]
    first = 0
    while first < len(views):
        written = os.writev(fd, views[first : first + 1024])  # IOV_MAX
        while written and first < len(views):
            if written >= views[first].nbytes:
                written -= views[first].nbytes
                first += 1
            else:
                views[first], written = views[first][written:], 0


def _write_file(path: Path, pieces: Sequence[memoryview | bytes], sync: bool = True) -> dict[str, Any]:
    """Write *pieces* to the new file *path* (and fsync it with *sync*); return its size and CRC-32."""
    crc = 0
    for piece in pieces:
        crc = crc32(piece, crc)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        _writev_all(fd, pieces)
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)
    return {"size": sum(memoryview(p).nbytes for p in pieces), "crc32": f"{crc:08x}"}


def fsync_dir(path: Path) -> None:
    """fsync *path*, a directory (to make a rename or deletion inside it durable) or a file."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_sync_pool: Any = None
_sync_pool_lock = threading.Lock()


def _pool() -> Any:
    global _sync_pool
    with _sync_pool_lock:
        if _sync_pool is None:
            from concurrent.futures import ThreadPoolExecutor

            _sync_pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="epochal-fsync")
        return _sync_pool


def _submit(function: Callable[..., Any], *args: Any) -> Any:
    """``function(*args)`` on the fsync pool; a future. Where no pool takes work (the
    interpreter is exiting), it runs here, and the future is already done."""
    for _ in range(2):
        try:
            return _pool().submit(function, *args)
        except RuntimeError:  # that pool was shut down before a fork (below): a new one
            continue
    from concurrent.futures import Future

    done: Future[Any] = Future()
    try:
        done.set_result(function(*args))
    except OSError as error:
        done.set_exception(error)
    return done


def _before_fork() -> None:
    """No idle fsync thread survives into a fork: a forked child (a DataLoader worker) has no
    use for them, and Python 3.12+ warns about forking a process with threads."""
    global _sync_pool
    with _sync_pool_lock:
        pool, _sync_pool = _sync_pool, None
    if pool is not None:
        pool.shutdown(wait=True)  # fsyncs in flight end first


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork)


class Flushes:
    """fsyncs issued concurrently, each as soon as its file is complete, awaited together.

    One after another, each fsync of a new file waits for its own journal commit (ext4 and
    XFS commit one transaction per fsync): four fsyncs cost four disk flushes. Issued together
    they join one commit, and the first starts the data's writeback while the rest of the
    checkpoint is still being encoded, so a checkpoint's files and its directory cost about
    what a single file's write+fsync costs (see bench/README.md). Nothing is published until
    :meth:`wait` returns: the order among these fsyncs does not matter, only that all end
    before the rename that publishes them.
    """

    def __init__(self) -> None:
        self._futures: list[Any] = []

    def start(self, path: Path) -> None:
        """Begin the fsync of *path* (a file or a directory) in the background."""
        self._futures.append(_submit(fsync_dir, path))

    def wait(self) -> None:
        """Return when every fsync started has ended; raise the first error, after all ended."""
        futures, self._futures = self._futures, []
        errors: list[BaseException] = []
        for future in futures:
            try:
                future.result()
            except BaseException as error:  # raised below, once none is running
                errors.append(error)
        if errors:
            raise errors[0]


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
        header, raw = _npy_header(array), _raw(array)
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


def _segment_body(part: LinkedSegment, reload: Callable[[Segment], Mapping[str, Any]]) -> memoryview:
    """The rows of segment *part* as the bytes between ``"rows":{`` and ``}}`` (its own bytes,
    verified; its rows re-encoded from ``reload`` when it fails verification)."""
    segment = part.segment
    data: bytes | bytearray
    try:
        data = _verified(part.source, segment.name, {"size": segment.size, "crc32": segment.crc32})
    except CorruptCheckpointError:
        data = encode_segment(reload(segment))
    if not (data.startswith(SEGMENT_HEAD) and data.endswith(b"}}")):  # not our encoding: parse it
        try:
            document = parse_json(part.source, segment.name, data)
        except CorruptCheckpointError:
            document = None
        rows: Any = document.get("rows") if isinstance(document, dict) else None
        data = encode_segment(rows if _rows_ok(rows) else reload(segment))
    return memoryview(data)[len(SEGMENT_HEAD) : -2]


def _merge_segment(tmp: Path, source: MergedSegment) -> Segment:
    bodies = [body for part in source.parts if len(body := _segment_body(part, source.reload))]
    new = memoryview(encode_segment(source.rows))[len(SEGMENT_HEAD) : -2]
    if len(new):
        bodies.append(new)
    pieces: list[memoryview | bytes] = [SEGMENT_HEAD]
    for k, body in enumerate(bodies):
        pieces += [b",", body] if k else [body]
    pieces.append(b"}}")
    written = _write_file(tmp / source.name, pieces, sync=False)
    ids: set[int] = {int(i) for i in source.rows}
    for part in source.parts:
        ids.update(part.segment.rows)
    return Segment(source.name, written["size"], written["crc32"], sorted(ids))


def _add_segment(tmp: Path, source: LinkedSegment | NewSegment | MergedSegment) -> tuple[Segment, bool]:
    """Put a log segment into the temporary checkpoint directory *tmp*; return what it is and
    whether its bytes were written here (not yet fsynced) rather than hard-linked."""
    if isinstance(source, MergedSegment):
        return _merge_segment(tmp, source), True
    if isinstance(source, NewSegment):
        rows = [int(i) for i in source.rows]
        written = _write_file(tmp / source.name, [encode_segment(source.rows)], sync=False)
        return Segment(source.name, written["size"], written["crc32"], rows), True
    segment, origin, target = source.segment, source.source / source.segment.name, tmp / source.segment.name
    try:
        os.link(origin, target)  # its bytes were fsynced when first written; the checksum is reused
    except FileNotFoundError:
        raise
    except OSError:  # no hard links here (or too many): copy it, verifying it on the way
        try:
            data = _verified(source.source, segment.name, {"size": segment.size, "crc32": segment.crc32})
        except CorruptCheckpointError as error:
            raise CheckpointWriteError(f"cannot reuse a log segment: {error}") from None
        _write_file(target, [bytes(data)], sync=False)
        return segment, True
    size = os.stat(target).st_size
    if size != segment.size:
        raise CheckpointWriteError(
            f"cannot reuse log segment {str(origin)!r}: it has {size} bytes, {segment.size} were written"
        )
    return segment, False


def write_checkpoint(
    directory: Path,
    name: str,
    snapshot: Snapshot,
    manifest: Mapping[str, Any],
    pointer: bool = True,
    segments: Sequence[LinkedSegment | NewSegment | MergedSegment] = (),
) -> CheckpointInfo:
    """Write *snapshot* atomically as checkpoint *name* in *directory*; return where and what.

    When *name* is taken (a checkpoint of another run at the same counters), ``-v2``, ``-v3``...
    is appended; an existing checkpoint is never overwritten. With *pointer*, ``latest`` (a
    symbolic link holding the checkpoint's name) is replaced atomically to name the new
    checkpoint, in the same directory sync as its rename.

    The order: ``data.bin`` (arrays written straight from memory, then the state), the new log
    segment and the manifest (its commit record last) are written, the earlier segments
    hard-linked; every new file and the temporary directory are fsynced together
    (:class:`Flushes`: each begins as soon as its file is complete); only then is the
    directory renamed into place (the publish point) and the parent directory fsynced.

    :raises CheckpointWriteError: naming the path, when the disk is full, permission is denied
        or any other OS error occurs; the temporary directory is removed and every earlier
        checkpoint is left as it was.
    """
    names = [s.segment.name if isinstance(s, LinkedSegment) else s.name for s in segments]
    if len(set(names)) != len(names) or not all(SEGMENT_RE.match(n) for n in names):
        raise ValueError(f"log segment names must be unique and match {SEGMENT_RE.pattern}: {names}")
    flushes = Flushes()
    tmp = directory / temp_name(name)
    pointer_tmp = directory / temp_name(POINTER) if pointer else None
    current = tmp
    try:
        tmp.mkdir()
        final_name = unique_name(directory, name)
        pieces, data = encode(snapshot)
        current = tmp / DATA
        fd = os.open(current, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            _writev_all(fd, pieces)
        finally:
            os.close(fd)
        flushes.start(current)
        current = tmp
        written = []
        for source in segments:
            segment, wrote = _add_segment(tmp, source)
            written.append(segment)
            if wrote:  # hard-linked ones were fsynced when first written
                flushes.start(tmp / segment.name)
        now = time.time_ns()
        document = {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "name": final_name,
            **manifest,
            "saved_at": datetime.datetime.fromtimestamp(now / 1e9, datetime.UTC).isoformat(),
            "saved_at_ns": now,
            **({SEGMENTS: [segment.name for segment in written]} if written else {}),
            "files": {DATA: data, **{s.name: {"size": s.size, "crc32": s.crc32} for s in written}},
        }
        current = tmp / MANIFEST  # its commit record is its last key: written last
        _write_file(current, [seal(manifest_text(document))], sync=False)
        flushes.start(current)
        current = tmp
        flushes.start(tmp)
        flushes.wait()  # unpublished until the rename below: every new file and the directory durable
        final = directory / final_name
        current = final
        os.rename(tmp, final)
        if pointer_tmp is not None:
            current = directory / POINTER
            os.symlink(final_name, pointer_tmp)  # a name, no data: made durable by the directory sync
            os.replace(pointer_tmp, current)
        current = directory
        fsync_dir(directory)
        return CheckpointInfo(final, document, written)
    except BaseException as error:
        with contextlib.suppress(OSError):  # the error that matters is the one being handled
            flushes.wait()
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


def resign(path: Path, manifest: Mapping[str, Any] | None = None) -> None:
    """Recompute the sizes and CRC-32s of checkpoint *path*'s files and rewrite its manifest
    (*manifest*, or the one there) and commit record: for tests that craft damaged checkpoints
    whose damage must reach the parsers rather than stop at a checksum. In ``data.bin`` the
    state is found again (after a change of length) and every array's CRC-32 recomputed."""
    document = dict(manifest if manifest is not None else json.loads((path / MANIFEST).read_bytes()))
    document.pop("commit", None)
    files = document.get("files")
    if isinstance(files, dict):
        fresh: dict[str, Any] = {}
        for name, entry in files.items():
            file = path / name
            if not file.is_file() or file.is_symlink():
                fresh[name] = entry
            elif name == DATA and isinstance(entry, dict):
                fresh[name] = _resign_data(file, entry)
            else:
                data = file.read_bytes()
                fresh[name] = {"size": len(data), "crc32": f"{crc32(data):08x}"}
        document["files"] = fresh
    data = manifest_text(document)
    if document.get("version") == 4:
        (path / MANIFEST).write_bytes(seal(data))
        (path / COMMIT).unlink(missing_ok=True)
    else:
        (path / MANIFEST).write_bytes(data)
        (path / COMMIT).write_bytes(commit_record(data))


def replace_state(path: Path, document: Any) -> None:
    """Put the JSON *document* in place of the state in checkpoint *path*'s ``data.bin`` and
    :func:`resign` it: for tests that craft damaged states."""
    manifest = json.loads((path / MANIFEST).read_bytes())
    manifest.pop("commit", None)
    at = manifest["files"][DATA]["state"]
    blob = (path / DATA).read_bytes()[:at]
    (path / DATA).write_bytes(blob + json.dumps(document).encode("ascii"))
    resign(path, manifest)


def _resign_data(file: Path, entry: Mapping[str, Any]) -> dict[str, Any]:
    blob = bytearray(file.read_bytes())
    prefix = re.compile(rb'\{\s*"format":\s*"' + f"{FORMAT}-state".encode("ascii") + rb'"')
    at = entry.get("state")
    if type(at) is not int or not prefix.match(blob, max(at, 0)):
        found = [m.start() for m in prefix.finditer(blob)]
        at = found[-1] if found else min(max(at if type(at) is int else 0, 0), len(blob))
    try:
        document = json.loads(blob[at:])
    except (ValueError, RecursionError):
        document = None
    if isinstance(document, dict) and isinstance(document.get("arrays"), list):
        entries = [e for e in document["arrays"] if isinstance(e, dict) and type(e.get("offset")) is int]
        ends = sorted({e["offset"] for e in entries} | {at})
        for item in entries:
            end = next((x for x in ends if x > item["offset"]), at)
            item["crc32"] = f"{crc32(blob[item['offset'] : end]):08x}"
        blob[at:] = json.dumps(document, separators=(",", ":"), allow_nan=True).encode("ascii")
        file.write_bytes(blob)
    return {**entry, "size": len(blob), "crc32": f"{crc32(blob[at:]):08x}", "state": at}


def unique_name(directory: Path, name: str) -> str:
    """*name*, or *name* with the first free ``-vN`` suffix."""
    candidate, version = name, 1
    while (directory / candidate).exists():
        version += 1
        candidate = f"{name}-v{version}"
    return candidate


def write_pointer(directory: Path, name: str) -> None:
    """Point ``<directory>/latest`` at checkpoint *name* atomically: a symbolic link holding the
    name (no data to sync), renamed over the old one, the directory fsynced."""
    tmp = directory / temp_name(POINTER)
    try:
        os.symlink(name, tmp)
        os.replace(tmp, directory / POINTER)
        fsync_dir(directory)
    except OSError as error:
        tmp.unlink(missing_ok=True)
        raise CheckpointWriteError(
            f"cannot update {str(directory / POINTER)!r}: {error.strerror or error}"
        ) from error


def read_pointer(directory: Path) -> str | None:
    """The checkpoint name ``<directory>/latest`` points at (None if absent or unreadable).

    ``latest`` is a symbolic link holding a bare name (written by format 4) or a small file
    holding it (formats 1-3). Only a checkpoint name (``ckpt-e<epoch>-i<iteration>[-v<n>]``, no
    path) is accepted, so the pointer never leads out of *directory*; a link to anything else,
    a FIFO or a device is not followed or read.
    """
    try:
        if os.path.islink(directory / POINTER):
            name = os.readlink(directory / POINTER)
        else:
            name = bytes(read_regular(directory, POINTER, MAX_POINTER_BYTES)).decode("utf-8").strip()
    except (OSError, CorruptCheckpointError, UnicodeDecodeError):
        return None
    return name if NAME_RE.match(name) else None


def make_directory(directory: Path) -> None:
    """Create *directory* and its missing parents, fsyncing each new one's parent (power loss)."""
    missing: list[Path] = []
    path = directory
    while not path.is_dir():
        missing.append(path)
        if path.parent == path:
            break
        path = path.parent
    for path in reversed(missing):
        try:
            path.mkdir()
        except FileExistsError:
            if not path.is_dir():
                raise
            continue
        fsync_dir(path.parent)


#: deletions still running in the background (see :func:`delete_checkpoint`).
_reapers: list[threading.Thread] = []


def delete_checkpoint(path: Path, wait: bool = True) -> None:
    """Remove a checkpoint: rename it to a temporary name (atomic), then delete that.

    With *wait* false the files are deleted in a background thread (unlinking a directory
    costs as much as a save on a busy disk, and nothing waits for it): the checkpoint is gone
    from its name at once, the temporary leftovers are removed later, or at the next start
    after a crash. :func:`finish_deletions` waits for them.
    """
    doomed = path.parent / temp_name(path.name)
    os.rename(path, doomed)
    if wait:
        shutil.rmtree(doomed, ignore_errors=True)
        return
    reaper = threading.Thread(
        target=shutil.rmtree, args=(doomed,), kwargs={"ignore_errors": True}, name="epochal-checkpoint-reaper"
    )
    reaper.start()
    _reapers.append(reaper)


def finish_deletions(keep: int = 0) -> None:
    """Wait for the deletions :func:`delete_checkpoint` runs in the background (the oldest
    first) until at most *keep* are still running."""
    while len(_reapers) > keep:
        _reapers.pop(0).join()


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
#
# Every reader is bounded: a file is looked at with lstat() before it is opened (a symbolic
# link, a FIFO or a device is refused without opening it), its size is compared with the size
# the manifest declares before anything is allocated, JSON is capped in size and depth, and
# every value read is type-checked; whatever is wrong ends in a CorruptCheckpointError naming
# the checkpoint, the file and the key.


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
    def order(self) -> tuple[int, int, int]:
        """Sort key: save sequence, then save time (both verified integers); a copy under
        another name (:attr:`renamed`) sorts before the checkpoint it copies."""
        sequence, saved = int(self.manifest.get("sequence", 0)), int(self.manifest.get("saved_at_ns", 0))
        return sequence, saved, 0 if self.renamed else 1

    @property
    def renamed(self) -> bool:
        """Whether the directory is not the name it was written under (a user's copy)."""
        written = self.manifest.get("name")
        return written is not None and written != self.path.name


def _corrupt(path: Path, name: str, message: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"checkpoint {str(path)!r}: {name} {message}")


def _open_regular(path: Path, name: str, limit: int, size: int | None = None) -> tuple[int, int]:
    """Open regular file *name* of *path* for reading; return ``(fd, size)``.

    The file is checked with ``lstat`` before it is opened (so a FIFO cannot block the read and
    a link to ``/dev/zero`` is never followed); then opened with ``O_NOFOLLOW | O_NONBLOCK`` and
    checked again; its size must be *size* when given, and at most *limit*.

    :raises CorruptCheckpointError: naming *path* and *name*.
    """
    file = path / name
    try:
        info = os.lstat(file)
    except FileNotFoundError:
        raise _corrupt(path, name, "is missing") from None
    except OSError as error:
        raise _corrupt(path, name, f"cannot be read: {error.strerror or error}") from None
    if stat.S_ISLNK(info.st_mode):
        raise _corrupt(path, name, "is a symbolic link (checkpoint files never are); refusing to follow it")
    if not stat.S_ISREG(info.st_mode):
        raise _corrupt(path, name, "is not a regular file (a FIFO, device or directory); refusing to read it")
    if size is not None and info.st_size != size:
        raise _corrupt(
            path, name, f"has {info.st_size} bytes, the manifest says {size} (truncated or overwritten)"
        )
    if info.st_size > limit:
        raise _corrupt(path, name, f"has {info.st_size} bytes, more than the {limit} allowed")
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(file, flags | getattr(os, "O_CLOEXEC", 0))
    except OSError as error:
        raise _corrupt(path, name, f"cannot be read: {error.strerror or error}") from None
    try:
        opened = os.fstat(fd)
    except OSError as error:
        os.close(fd)
        raise _corrupt(path, name, f"cannot be read: {error.strerror or error}") from None
    if not stat.S_ISREG(opened.st_mode) or opened.st_size != info.st_size:
        os.close(fd)
        raise _corrupt(path, name, "changed while it was opened; refusing to read it")
    return fd, info.st_size


def _read_into(path: Path, name: str, fd: int, view: memoryview, offset: int, crc: int = 0) -> int:
    """Fill *view* from *fd* at *offset*, in pieces checksummed while in the cache; return the
    CRC-32 (continued from *crc*) of what was read."""
    got, size = 0, view.nbytes
    try:
        while got < size:
            n = os.preadv(fd, [view[got : got + READ_CHUNK]], offset + got)
            if n == 0:
                raise _corrupt(path, name, "changed size while it was read")
            crc = crc32(view[got : got + n], crc)
            got += n
    except OSError as error:
        raise _corrupt(path, name, f"cannot be read: {error.strerror or error}") from None
    return crc


def read_regular(path: Path, name: str, limit: int, size: int | None = None) -> bytearray:
    """The bytes of regular file *name* in *path*, refusing links, FIFOs, devices, odd sizes.

    See :func:`_open_regular`; the file is read to exactly its size (growth is detected).

    :raises CorruptCheckpointError: naming *path* and *name*.
    """
    fd, length = _open_regular(path, name, limit, size)
    try:
        data = bytearray(length)
        _read_into(path, name, fd, memoryview(data), 0)
        try:
            grown = os.pread(fd, 1, length)
        except OSError as error:
            raise _corrupt(path, name, f"cannot be read: {error.strerror or error}") from None
        if grown:
            raise _corrupt(path, name, "changed size while it was read")
    finally:
        os.close(fd)
    return data


def _verified(path: Path, name: str, expected: Mapping[str, Any]) -> bytearray:
    """Read file *name* of checkpoint *path*; check its size (first) and CRC-32."""
    data = read_regular(path, name, MAX_FILE_BYTES, expected["size"])
    crc = f"{crc32(data):08x}"
    if crc != expected["crc32"]:
        raise _corrupt(path, name, f"fails its checksum (crc32 {crc}, manifest {expected['crc32']})")
    return data


def _depth_ok(value: Any, limit: int) -> bool:
    """Whether *value* (parsed JSON) nests at most *limit* containers deep (iterative walk)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if type(item) is dict:
            children: Iterable[Any] = item.values()
        elif type(item) is list:
            children = item
        else:
            continue
        if depth > limit:
            return False
        stack.extend((child, depth + 1) for child in children if type(child) in (dict, list))
    return True


def parse_json(path: Path, name: str, data: bytes | bytearray, depth: int = MAX_JSON_DEPTH) -> Any:
    """Parse *data* (file *name* of *path*) as JSON nested at most *depth* deep."""
    try:
        value = json.loads(data)
    except RecursionError:
        raise _corrupt(path, name, f"nests deeper than {depth} levels") from None
    except (ValueError, UnicodeDecodeError) as error:
        raise _corrupt(path, name, f"is not valid JSON ({str(error)[:200]})") from None
    if not _depth_ok(value, depth):
        raise _corrupt(path, name, f"nests deeper than {depth} levels")
    return value


def _is_int(value: Any, low: int = 0, high: int = MAX_COUNT) -> bool:
    return type(value) is int and low <= value <= high


def _check_file_entry(path: Path, key: str, entry: Any) -> None:
    if not (
        isinstance(entry, dict)
        and _is_int(entry.get("size"), 0, MAX_FILE_BYTES)
        and isinstance(entry.get("crc32"), str)
        and CRC_RE.match(entry["crc32"])
    ):
        raise _corrupt(
            path, MANIFEST, f"key files.{key} is not {{size: int, crc32: 8 hex digits}}: {entry!r:.100}"
        )


def check_manifest(path: Path, manifest: Any) -> dict[str, Any]:
    """Check the keys and types of a parsed manifest; return it.

    :raises ForeignCheckpointError: another format, or a newer version.
    :raises CorruptCheckpointError: a key missing or of the wrong type, naming it.
    """
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ForeignCheckpointError(
            f"{str(path)!r} is not an epochal checkpoint ({MANIFEST} of another format)"
        )
    version = manifest.get("version")
    if type(version) is not int or version not in READ_VERSIONS:
        raise ForeignCheckpointError(
            f"checkpoint {str(path)!r} has format version {version!r:.40}; this "
            f"epochal-checkpoint reads versions {', '.join(map(str, READ_VERSIONS))} "
            "(upgrade epochal-checkpoint)"
        )

    def bad(key: str, what: str) -> CorruptCheckpointError:
        return _corrupt(path, MANIFEST, f"key {key} is not {what}: {manifest.get(key)!r:.100}")

    for key in ("sequence", "saved_at_ns", "epoch", "iteration"):
        # the order of format-3 checkpoints: a missing one would rank a checkpoint silently as
        # the oldest, so that it is never read, never reported
        required = version >= 3 and key in ("sequence", "saved_at_ns")
        if (key in manifest or required) and not _is_int(manifest.get(key)):
            raise bad(key, "a non-negative integer")
    for key in ("run_id", "name", "reason"):
        if (key in manifest or (version >= 3 and key == "name")) and not isinstance(manifest.get(key), str):
            raise bad(key, "a string")
    for key in ("lineage", OWN):
        value = manifest.get(key, [])
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise bad(key, "a list of strings")
    metric = manifest.get("metric")
    if metric is not None and (type(metric) not in (int, float)):
        raise bad("metric", "a number or null")
    for key in ("plugins",):
        if key in manifest and not isinstance(manifest[key], dict):
            raise bad(key, "a table")
    segments = manifest.get(SEGMENTS, [])
    if (
        not isinstance(segments, list)
        or not all(isinstance(n, str) and SEGMENT_RE.match(n) for n in segments)
        or len(set(segments)) != len(segments)
    ):
        raise _corrupt(path, MANIFEST, f"has a bad {SEGMENTS} list")
    files = manifest.get("files")
    expected = {*((DATA,) if version >= 4 else DATA_FILES), *segments}
    if not isinstance(files, dict) or set(files) != expected:
        listed = sorted(files) if isinstance(files, dict) else files
        raise _corrupt(path, MANIFEST, f"lists files {listed!r:.200}, expected {sorted(expected)!r:.200}")
    for key, entry in files.items():
        _check_file_entry(path, key, entry)
    if version >= 4 and not _is_int(files[DATA].get("state"), 0, files[DATA]["size"]):
        raise _corrupt(path, MANIFEST, f"key files.{DATA}.state is not an offset within the file")
    return manifest


def read_commit(path: Path) -> tuple[int, str] | None:
    """The manifest size and CRC-32 that ``<path>/commit`` records (None: no commit record)."""
    try:
        os.lstat(path / COMMIT)
    except FileNotFoundError:
        return None
    except OSError:
        pass  # read_regular names the problem
    text = bytes(read_regular(path, COMMIT, MAX_COMMIT_BYTES))
    match = COMMIT_RE.match(text)
    if match is None:
        raise _corrupt(path, COMMIT, "is not a commit record (damaged)")
    size, crc, check = int(match[1]), match[2].decode(), match[3].decode()
    if f"{crc32(text[: match.start(3)]):08x}" != check:
        raise _corrupt(path, COMMIT, "fails its own checksum (damaged)")
    return size, crc


def commit_record(manifest: bytes) -> bytes:
    """The bytes of the commit record of a manifest: its size and CRC-32, then their CRC-32."""
    head = f"{COMMIT_MAGIC} {len(manifest)} {crc32(manifest):08x} ".encode("ascii")
    return head + f"{crc32(head):08x}\n".encode("ascii")


def read_manifest(path: Path) -> dict[str, Any]:
    """Read and check ``<path>/manifest.json`` against the commit record written after it.

    A checkpoint of format version 3 must have its commit record; an older one (written before
    commit records existed) has none and its manifest is only type-checked.

    :raises ForeignCheckpointError: if *path* has no manifest or it is not ours.
    :raises CorruptCheckpointError: if the manifest or commit record is damaged, naming the file and why.
    """
    try:
        os.lstat(path / MANIFEST)
    except FileNotFoundError:
        raise ForeignCheckpointError(
            f"{str(path)!r} is not an epochal checkpoint (no {MANIFEST}; an incomplete or foreign directory)"
        ) from None
    except OSError:
        pass
    commit = read_commit(path)
    size = commit[0] if commit is not None else None
    data = read_regular(path, MANIFEST, MAX_MANIFEST_BYTES, size)
    if commit is not None and f"{crc32(data):08x}" != commit[1]:
        raise _corrupt(
            path, MANIFEST, f"fails its checksum (crc32 {crc32(data):08x}, {COMMIT} says {commit[1]})"
        )
    sealed = SEAL_RE.search(data, max(len(data) - 64, 0))
    if sealed is not None and f"{crc32(memoryview(data)[: sealed.start(1)]):08x}" != sealed[1].decode():
        raise _corrupt(path, MANIFEST, "fails its checksum (its commit record does not match)")
    manifest = check_manifest(path, parse_json(path, MANIFEST, data, depth=8))
    if "commit" in manifest and sealed is None:
        raise _corrupt(path, MANIFEST, "has a damaged commit record (key commit)")
    manifest.pop("commit", None)
    if manifest["version"] >= 4 and sealed is None:
        raise _corrupt(path, MANIFEST, "has no commit record (the checkpoint was never committed)")
    if commit is None and sealed is None and manifest["version"] >= 3:
        raise _corrupt(path, COMMIT, "is missing (the checkpoint was never committed)")
    return manifest


def list_checkpoints(directory: Path) -> tuple[list[CheckpointInfo], list[tuple[str, str]]]:
    """The complete checkpoints in *directory*, oldest first, and the ignored entries with why.

    A checkpoint counts as complete when its directory (not a link) has its final name and a
    manifest of this format that verifies against its commit record; the order is the verified
    manifests' save sequence. Its other files are verified when it is read.
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
        if not NAME_RE.match(entry.name):
            continue
        if entry.is_symlink():
            ignored.append((entry.name, "a symbolic link, not a checkpoint written here"))
            continue
        if not entry.is_dir(follow_symlinks=False):
            continue
        try:
            found.append(CheckpointInfo(Path(entry.path), read_manifest(Path(entry.path))))
        except (ForeignCheckpointError, CorruptCheckpointError) as error:
            ignored.append((entry.name, str(error)))
    found.sort(key=lambda info: info.order)
    return found, ignored


def read_checkpoint(path: Path, model_only: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
    """Read and verify the checkpoint at *path*; return ``(state, manifest)``.

    Every file is checked against the manifest's size and CRC-32 before it is parsed; arrays
    are read without pickle. With *model_only* only ``state["model"]`` is built (the other
    arrays and the log segments are skipped).

    :raises ForeignCheckpointError: *path* is not an epochal checkpoint.
    :raises CorruptCheckpointError: a file is missing, truncated, fails its checksum or holds
        values of the wrong type (naming the file and key).
    :raises UnsafeCheckpointError: an array holds a pickle payload (object dtype).
    """
    info = read_checkpoint_info(path, model_only)
    return info.state, info.manifest


@dataclass
class ReadCheckpoint(CheckpointInfo):
    """A checkpoint read and verified: :class:`CheckpointInfo` and its state."""

    state: dict[str, Any] = field(default_factory=dict)
    #: log segments that failed verification, with why (their rows are lost).
    damaged: list[tuple[str, str]] = field(default_factory=list)


def _rows_ok(rows: Any) -> bool:
    return isinstance(rows, dict) and all(isinstance(r, dict) and _ROW_KEY.match(k) for k, r in rows.items())


def _read_segments(
    path: Path, manifest: Mapping[str, Any], tree: dict[str, Any]
) -> tuple[list[Segment], list[int], list[tuple[str, str]]]:
    """Read the log segments of *manifest* into ``tree["log"]["rows"]`` (rows in iteration order).

    Return the segments read, the rows found in ``state.json`` and the damaged segments with
    why. A damaged segment costs only its rows: the others and the rest of the state are used.
    """
    names = manifest.get(SEGMENTS, [])
    if not names:
        return [], [], []
    state = DATA if manifest["version"] >= 4 else STATE
    log: Any = tree.get("log")
    inline: Any = log.get("rows") if isinstance(log, dict) else None
    if not isinstance(inline, dict):
        raise _corrupt(path, state, "has no log rows (key log.rows) to complete")
    merged: dict[str, Any] = {}
    segments = []
    damaged: list[tuple[str, str]] = []
    for name in names:
        expected = manifest["files"][name]
        try:
            document = parse_json(path, name, _verified(path, name, expected))
            rows: Any = document.get("rows") if isinstance(document, dict) else None
            if not isinstance(document, dict) or document.get("format") != LOG_FORMAT:
                raise _corrupt(path, name, "is not a log segment (key format)")
            if not _rows_ok(rows):
                raise _corrupt(path, name, "key rows is not a table of {iteration: row}")
        except CorruptCheckpointError as error:
            damaged.append((name, str(error)))
            continue
        segments.append(Segment(name, expected["size"], expected["crc32"], [int(i) for i in rows]))
        merged.update(rows)
    if not _rows_ok(inline):
        raise _corrupt(path, state, "key log.rows is not a table of {iteration: row}")
    merged.update(inline)
    inline_rows = [int(i) for i in inline]
    log["rows"] = {i: merged[i] for i in sorted(merged, key=int) if merged[i]}
    return segments, inline_rows, damaged


def _check_index(path: Path, index: Any, ints: Any, name: str = STATE, sealed: bool = False) -> None:
    """Check the array and big-int entries of a state (with *sealed*: each array has a CRC-32)."""
    if not isinstance(index, list):
        raise _corrupt(path, name, "key arrays is not a list")
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
            and all(_is_int(n) for n in entry["shape"])
            and _is_int(entry.get("offset"), 0, MAX_FILE_BYTES)
            and (not sealed or (isinstance(entry.get("crc32"), str) and CRC_RE.match(entry["crc32"])))
        ):
            raise _corrupt(path, name, f"key arrays[{k}] is not a valid array entry: {entry!r:.200}")
    if not isinstance(ints, list):
        raise _corrupt(path, name, "key ints is not a list")
    for k, entry in enumerate(ints):
        if not (
            isinstance(entry, dict)
            and isinstance(entry.get("path"), list)
            and all(type(p) in (str, int) for p in entry["path"])
            and isinstance(entry.get("hex"), str)
            and HEX_RE.match(entry["hex"])
        ):
            raise _corrupt(path, name, f"key ints[{k}] is not a valid big-int entry: {entry!r:.200}")


def _parse_npy_header(where: str, head: bytes) -> tuple[tuple[int, ...], bool, np.dtype[Any], int]:
    """Parse the ``.npy`` header at the start of *head* with numpy's safe literal parser (at
    most 64 KiB); return shape, Fortran order, dtype and the header's length. Object dtypes
    (pickle payloads) are refused."""
    import numpy as np

    stream = io.BytesIO(head)
    try:
        version = np.lib.format.read_magic(stream)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(stream, max_header_size=1 << 16)
        elif version == (2, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(stream, max_header_size=1 << 16)
        else:
            raise ValueError(f"unsupported .npy version {version}")
    except ValueError as error:
        if "pickle" in str(error) or "object" in str(error).lower():
            raise UnsafeCheckpointError(
                f"{where} holds a pickle payload (object dtype); epochal never unpickles "
                "checkpoint data, refusing to load it"
            ) from None
        raise CorruptCheckpointError(f"{where} has a bad .npy header: {str(error)[:200]}") from None
    except (OSError, EOFError, KeyError, TypeError, SyntaxError, MemoryError, RecursionError) as error:
        raise CorruptCheckpointError(f"{where} has a bad .npy header: {str(error)[:200]}") from None
    if dtype.hasobject:
        raise UnsafeCheckpointError(
            f"{where} holds a pickle payload (object dtype); epochal never unpickles "
            "checkpoint data, refusing to load it"
        )
    return shape, fortran, dtype, stream.tell()


def _check_header(where: str, entry: Mapping[str, Any], dtype: Any, shape: Sequence[int]) -> None:
    if dtype.str != entry["dtype"] or list(shape) != entry["shape"]:
        raise CorruptCheckpointError(
            f"{where} is {dtype.str} {list(shape)}, the index says {entry['dtype']} {entry['shape']}"
        )


def _read_array(path: Path, buffer: bytearray, entry: Mapping[str, Any]) -> np.ndarray:
    """The array *entry* of ``arrays.npy`` (held in *buffer*): header checked, then a view."""
    import numpy as np

    where = f"checkpoint {str(path)!r}: {ARRAYS} array {key_path(entry['path'])!r}"
    offset = entry["offset"]
    shape, fortran, dtype, length = _parse_npy_header(where, bytes(buffer[offset : offset + NPY_HEADER_MAX]))
    _check_header(where, entry, dtype, shape)
    count = math.prod(shape)
    start = offset + length
    if start + count * dtype.itemsize > len(buffer):
        raise CorruptCheckpointError(
            f"{where} needs {count * dtype.itemsize} bytes, {ARRAYS} has {max(len(buffer) - start, 0)} left"
        )
    if dtype.itemsize == 0:
        array = np.zeros(shape, dtype)
    else:
        array = np.frombuffer(buffer, dtype, count, start).reshape(shape, order="F" if fortran else "C")
    if not array.flags.aligned:
        array = array.copy(order="K")
    return array


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
        raise _corrupt(path, DATA, f"key arrays: offset {offset} is past the end of the arrays ({end})")
    try:
        head = os.pread(fd, min(NPY_HEADER_MAX, end - offset), offset)
    except OSError as error:
        raise _corrupt(path, DATA, f"cannot be read: {error.strerror or error}") from None
    shape, fortran, dtype, length = _parse_npy_header(where, head)
    _check_header(where, entry, dtype, shape)
    nbytes = math.prod(shape) * dtype.itemsize
    start = offset + length
    if start + nbytes > end:
        raise CorruptCheckpointError(f"{where} needs {nbytes} bytes, {DATA} has {max(end - start, 0)} left")
    return _Record(entry, shape, fortran, dtype, start, nbytes, crc32(head[:length]))


def _read_records(path: Path, fd: int, entries: Sequence[Mapping[str, Any]], end: int) -> list[np.ndarray]:
    """The arrays *entries* of ``data.bin``: every header checked first, then the arrays read
    into one buffer allocated for them (64-byte aligned slices; one allocation is markedly
    faster than one per array), each checksummed while it is read. Records may not overlap, so
    the buffer is never larger than the file."""
    import numpy as np

    records = [_record(path, fd, entry, end) for entry in entries]
    previous = 0
    for record in sorted(records, key=lambda r: r.entry["offset"]):
        if record.entry["offset"] < previous:
            where = key_path(record.entry["path"])
            raise _corrupt(path, DATA, f"key arrays: array {where!r} overlaps the array before it")
        previous = record.start + record.nbytes
    places, total = [], 0
    for record in records:
        places.append(total)
        total += -(-record.nbytes // 64) * 64
    buffer = np.empty(total + 64, np.uint8)
    base = -buffer.ctypes.data % 64
    arrays = []
    for record, at in zip(records, places, strict=True):
        piece = buffer[base + at : base + at + record.nbytes]
        crc = _read_into(path, DATA, fd, memoryview(piece.data), record.start, record.crc)
        if f"{crc:08x}" != record.entry["crc32"]:
            where = f"checkpoint {str(path)!r}: {DATA} array {key_path(record.entry['path'])!r}"
            raise CorruptCheckpointError(
                f"{where} fails its checksum (crc32 {crc:08x}, the index says {record.entry['crc32']})"
            )
        order = "F" if record.fortran else "C"
        if record.dtype.itemsize == 0:
            arrays.append(np.zeros(record.shape, record.dtype))
        else:
            arrays.append(piece.view(record.dtype).reshape(record.shape, order=order))
    return arrays


def _set_checked(path: Path, tree: Any, entry: Mapping[str, Any], value: Any, name: str = STATE) -> Any:
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
        raise _corrupt(path, name, f"has no key {where!r} for an array or big int") from None
    parent[last] = value  # type: ignore[index]
    return tree


def _get_path(tree: Any, path: Sequence[Any]) -> Any:
    key: Any
    for key in path:
        if (type(tree) is dict and type(key) is str) or (type(tree) is list and type(key) is int):
            tree = tree[key]  # type: ignore[index]
        else:
            raise TypeError(key)
    return tree


def read_checkpoint_info(path: Path, model_only: bool = False) -> ReadCheckpoint:
    """Read and verify the checkpoint at *path*, as :func:`read_checkpoint`; also return its segments.

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
    manifest = read_manifest(path)
    files = manifest["files"]
    if manifest["version"] >= 4:
        tree, name = _read_data(path, files[DATA], model_only), DATA
    else:
        tree, name = _read_state_and_arrays(path, files, model_only), STATE
    if not isinstance(tree, dict):
        raise _corrupt(path, name, "key tree is not a table (the state is a dict)")
    segments, inline, damaged = ([], [], []) if model_only else _read_segments(path, manifest, tree)
    return ReadCheckpoint(path, manifest, segments, inline, tree, damaged)


def _state_document(path: Path, name: str, data: bytes | bytearray, sealed: bool) -> tuple[Any, Any, Any]:
    document = parse_json(path, name, data)
    if not isinstance(document, dict) or document.get("format") != f"{FORMAT}-state":
        raise _corrupt(path, name, "is not a checkpoint state (key format)")
    tree: Any = document.get("tree")
    index: Any = document.get("arrays")
    ints: Any = document.get("ints")
    _check_index(path, index, ints, name, sealed)
    return tree, index, ints


def _only_model(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in entries if e["path"][:1] == ["model"]]


def _read_data(path: Path, expected: Mapping[str, Any], model_only: bool) -> Any:
    """The state tree of format 4's ``data.bin``: the JSON state (checked against the manifest's
    CRC-32) and then its arrays (all, or the model's), read into one buffer and each checked
    against its own CRC-32 on the way (see :func:`_read_records`)."""
    fd, size = _open_regular(path, DATA, MAX_FILE_BYTES, expected["size"])
    try:
        at = expected["state"]
        state = bytearray(size - at)
        crc = _read_into(path, DATA, fd, memoryview(state), at)
        if f"{crc:08x}" != expected["crc32"]:
            why = f"state fails its checksum (crc32 {crc:08x}, manifest {expected['crc32']})"
            raise _corrupt(path, DATA, why)
        tree, index, ints = _state_document(path, DATA, state, sealed=True)
        del state
        if model_only:
            index, ints = _only_model(index), _only_model(ints)
        for entry, array in zip(index, _read_records(path, fd, index, at), strict=True):
            tree = _set_checked(path, tree, entry, array[()] if entry["kind"] == "scalar" else array, DATA)
    finally:
        os.close(fd)
    for entry in ints:
        tree = _set_checked(path, tree, entry, int(entry["hex"], 16), DATA)
    return tree


def _read_state_and_arrays(path: Path, files: Mapping[str, Any], model_only: bool) -> Any:
    """The state tree of formats 1-3: ``state.json``, then ``arrays.npy`` read whole."""
    tree, index, ints = _state_document(path, STATE, _verified(path, STATE, files[STATE]), sealed=False)
    if model_only:
        index, ints = _only_model(index), _only_model(ints)
    arrays = _verified(path, ARRAYS, files[ARRAYS]) if index else bytearray()
    for entry in index:
        if entry["offset"] >= len(arrays):
            raise _corrupt(path, STATE, f"key arrays: offset {entry['offset']} is past the end of {ARRAYS}")
        array = _read_array(path, arrays, entry)
        tree = _set_checked(path, tree, entry, array[()] if entry["kind"] == "scalar" else array)
    for entry in ints:
        tree = _set_checked(path, tree, entry, int(entry["hex"], 16))
    return tree


def read_state_document(path: Path) -> dict[str, Any]:
    """The JSON state document of checkpoint *path* as written (the tree with ``null`` where
    arrays sit, the array index): ``data.bin``'s state (format 4) or ``state.json`` (1-3).
    Checked against the manifest's checksum; for tools and tests that look inside."""
    manifest = read_manifest(Path(path))
    if manifest["version"] >= 4:
        entry = manifest["files"][DATA]
        data = read_regular(Path(path), DATA, MAX_FILE_BYTES, entry["size"])[entry["state"] :]
        name = DATA
        if f"{crc32(data):08x}" != entry["crc32"]:
            raise _corrupt(Path(path), DATA, "state fails its checksum")
    else:
        data, name = _verified(Path(path), STATE, manifest["files"][STATE]), STATE
    document = parse_json(Path(path), name, data)
    if not isinstance(document, dict):
        raise _corrupt(Path(path), name, "is not a checkpoint state (key format)")
    return document


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


def warn_damaged_segments(read: ReadCheckpoint, stacklevel: int = 3) -> None:
    """Warn once for the log segments of *read* that failed verification, naming the rows lost."""
    import warnings

    for name, why in read.damaged:
        match = re.match(r"^log-\d+-i(\d+)-(\d+)\.json$", name)
        rows = f"rows {int(match[1])}..{int(match[2])}" if match else "its rows"
        warnings.warn(
            f"{why}; the training log's {rows} held by it are lost (model, optimizer, RNG and "
            "plugin state are intact and are used)",
            RuntimeWarning,
            stacklevel=stacklevel,
        )


def find_latest(directory: Path, model_only: bool = False) -> tuple[ReadCheckpoint, list[tuple[Path, str]]]:
    """Read the newest complete checkpoint of *directory* that verifies, as :func:`load_latest`.

    Return it and the newer checkpoints that failed verification, with why.
    """
    import warnings

    infos, ignored = list_checkpoints(directory)
    if not infos:
        extra = f"; ignored: {'; '.join(f'{n} ({why})' for n, why in ignored)}" if ignored else ""
        raise CheckpointNotFoundError(f"no complete checkpoint in {str(directory)!r}{extra}")
    for name, why in ignored:
        warnings.warn(f"ignoring {name} in {str(directory)!r}: {why}", RuntimeWarning, stacklevel=3)
    failures: list[tuple[Path, str]] = []
    unsafe = False
    for info in reversed(infos):
        try:
            read = read_checkpoint_info(info.path, model_only=model_only)
        except (CorruptCheckpointError, UnsafeCheckpointError, ForeignCheckpointError) as error:
            unsafe = unsafe or isinstance(error, UnsafeCheckpointError)
            failures.append((info.path, str(error)))
            warnings.warn(f"{error}; trying the previous checkpoint", RuntimeWarning, stacklevel=3)
            continue
        warn_damaged_segments(read, stacklevel=4)
        return read, failures
    kind = UnsafeCheckpointError if unsafe else CorruptCheckpointError
    raise kind(f"every checkpoint in {str(directory)!r} is corrupt: " + "; ".join(why for _, why in failures))


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
