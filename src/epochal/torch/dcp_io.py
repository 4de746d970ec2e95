"""Reading torch.distributed.checkpoint (DCP) checkpoints without running code from them, and
DCP's errors as one line.

Stock DCP unpickles a checkpoint's ``.metadata`` (``FileSystemReader.read_metadata``) and reads
every value that is not a tensor with ``torch.load(weights_only=False)`` (its default load
planner): whoever can write a checkpoint's directory could run code in every process that
reads it. Here ``.metadata`` goes through :class:`MetadataUnpickler`, which admits only DCP's
metadata classes, ``torch.Size``, torch's dtypes and layouts and path objects, and each value
through ``torch.load(weights_only=True)``; the metadata read is then checked
(:func:`parse_metadata`: every record in a ``__R_N.distcp`` file of the checkpoint itself, no
storage transforms). The files stay DCP's own: stock DCP reads them, and epochal writes them
with stock DCP.

DCP's ``CheckpointException`` derives from ``BaseException`` (``except Exception`` misses it)
and DCP logs tracebacks on Python's root logger: :func:`load` and :func:`consolidated` turn
every failure into one :class:`DamagedShardsError` (the files cannot be read) or
:class:`ShardsMismatchError` (they do not fit the model), and :func:`quiet` keeps DCP's log
records off stderr.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import math
import pickle
import re
import threading
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path, PosixPath, PurePosixPath, PureWindowsPath, WindowsPath
from typing import Any, ClassVar

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import filesystem as _filesystem
from torch.distributed.checkpoint import metadata as _md
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, _EmptyStateDictLoadPlanner

from epochal.errors import EpochalError

__all__ = [
    "DamagedShardsError",
    "MetadataUnpickler",
    "RecordError",
    "ShardsMismatchError",
    "check_values",
    "checkpoint_exception",
    "consolidated",
    "load",
    "one_line",
    "parse_metadata",
    "quiet",
    "raise_translated",
    "reader",
]

#: the names of the files DCP writes for epochal (one file per rank, and the coordinator's metadata).
SHARD_FILE = re.compile(r"^__\d{1,6}_\d{1,6}\.distcp$")
METADATA = ".metadata"
#: the largest ``.metadata`` read (a model with a million tensors has a few hundred MB of it).
MAX_METADATA_BYTES = 1 << 30


class DamagedShardsError(EpochalError):
    """A sharded checkpoint's DCP files cannot be read: ``.metadata`` is not DCP's metadata (a
    pickle of something else, a record outside the checkpoint) or a record does not read."""


class ShardsMismatchError(EpochalError):
    """A sharded checkpoint's tensors do not fit the model (missing keys, other shapes)."""


class RecordError(ValueError):
    """A record of a ``.distcp`` file (:attr:`file`) is not what its metadata says."""

    def __init__(self, file: str, message: str) -> None:
        super().__init__(message)
        self.file = file


# -- .metadata without code ---------------------------------------------------------------------

_DATACLASSES = (
    _md.Metadata,
    _md.MetadataIndex,
    _md.TensorStorageMetadata,
    _md.BytesStorageMetadata,
    _md.ChunkStorageMetadata,
    _md.StorageMeta,
    _filesystem._StorageInfo,
)


def _admitted() -> dict[tuple[str, str], Any]:
    found: dict[tuple[str, str], Any] = {
        (kind.__module__, kind.__qualname__): kind
        for kind in (*_DATACLASSES, _md.TensorProperties, _md._MEM_FORMAT_ENCODING)
    }
    found[("torch", "Size")] = torch.Size
    found[("torch.serialization", "_get_layout")] = torch.serialization._get_layout  # layouts by name
    for name, value in vars(torch).items():
        if isinstance(value, torch.dtype):
            found[("torch", name)] = value
    for kind in (PosixPath, WindowsPath, PurePosixPath, PureWindowsPath):  # StorageMeta.checkpoint_id
        found[("pathlib", kind.__name__)] = kind
    return found


_ADMITTED = _admitted()
_FIELDS = {kind: {f.name for f in dataclasses.fields(kind)} for kind in _DATACLASSES}


class MetadataUnpickler(pickle._Unpickler):
    """Unpickles DCP's ``.metadata`` and nothing else: a global outside DCP's metadata classes,
    ``torch.Size``, torch's dtypes and layouts and path objects is refused, and so is setting the
    attributes of anything but a fresh metadata record (a class's, an enum member's).

    Python's own unpickler (``pickle._Unpickler``), for its ``BUILD`` can be checked."""

    dispatch: ClassVar[dict[int, Any]] = dict(pickle._Unpickler.dispatch)

    def find_class(self, module: str, name: str) -> Any:
        try:
            return _ADMITTED[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(f"holds {module}.{name}, which is not DCP metadata") from None

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("holds a persistent reference, which is not DCP metadata")

    stack: list[Any]

    def _build(self) -> None:
        state, inst = self.stack[-1], self.stack[-2]
        if type(inst) is _md.TensorProperties:
            if not (type(state) is tuple and len(state) == 5):
                raise pickle.UnpicklingError("holds tensor properties that are not DCP's")
        elif type(inst) not in _DATACLASSES or type(state) is not dict or not all(map(_is_str, state)):
            kind = type(inst).__name__
            raise pickle.UnpicklingError(f"sets the attributes of a {kind}, which DCP never does")
        elif unknown := sorted(set(state) - _FIELDS[type(inst)]):
            raise pickle.UnpicklingError(
                f"sets {type(inst).__name__}.{unknown[0]:.50}, which is no field of it"
            )
        pickle._Unpickler.load_build(self)  # type: ignore[attr-defined]

    dispatch[pickle.BUILD[0]] = _build


def _is_str(value: Any) -> bool:
    return type(value) is str


def _is_size(value: Any, length: int | None = None) -> bool:
    return (
        type(value) is torch.Size
        and all(type(v) is int and v >= 0 for v in value)
        and (length is None or len(value) == length)
    )


def _check_tensor(fqn: str, entry: Any, storage: dict[Any, Any]) -> None:
    props = entry.properties
    if type(props) is not _md.TensorProperties or not isinstance(props.dtype, torch.dtype):
        raise ValueError(f"tensor {fqn!r} has no dtype")
    if not _is_size(entry.size) or type(entry.chunks) is not list:
        raise ValueError(f"tensor {fqn!r} has a bad size or chunk list")
    for chunk in entry.chunks:
        if type(chunk) is not _md.ChunkStorageMetadata or not (
            _is_size(chunk.offsets, len(entry.size)) and _is_size(chunk.sizes, len(entry.size))
        ):
            raise ValueError(f"tensor {fqn!r} has a bad chunk")
        if any(o + s > n for o, s, n in zip(chunk.offsets, chunk.sizes, entry.size, strict=True)):
            raise ValueError(f"tensor {fqn!r} has a chunk outside its size")
        record = storage.get(_md.MetadataIndex(fqn, chunk.offsets))
        if record is None:
            raise ValueError(f"tensor {fqn!r} has a chunk with no record in the files")
        # the chunks hold the tensor's bytes: a reader allocates no more than the files hold
        if record.length < math.prod(chunk.sizes) * props.dtype.itemsize:
            raise ValueError(f"tensor {fqn!r} has a chunk larger than its record")
    if sum(math.prod(chunk.sizes) for chunk in entry.chunks) < math.prod(entry.size):
        raise ValueError(f"tensor {fqn!r} is not covered by its chunks")


def _check_storage(storage: Any, files: Mapping[str, int] | None) -> None:
    if type(storage) is not dict:
        raise ValueError("holds no table of records")
    for index, info in storage.items():
        if type(index) is not _md.MetadataIndex or type(index.fqn) is not str:
            raise ValueError("holds a record without a name")
        if not (index.offset is None or _is_size(index.offset)) or type(index.index) not in (int, type(None)):
            raise ValueError(f"record {index.fqn!r} has a bad index")
        if type(info) is not _filesystem._StorageInfo:
            raise ValueError(f"record {index.fqn!r} is not a file record")
        path = info.relative_path
        if type(path) is not str or not SHARD_FILE.match(path):
            raise ValueError(f"record {index.fqn!r} is in {path!r:.100}, not a file of this checkpoint")
        offset, length = info.offset, info.length
        if not (type(offset) is int and type(length) is int and offset >= 0 and length > 0):
            raise ValueError(f"record {index.fqn!r} has a bad offset or length")
        if info.transform_descriptors:  # epochal writes none; DCP's transforms decompress
            raise ValueError(f"record {index.fqn!r} asks for storage transforms")
        if files is not None:
            if path not in files:
                raise ValueError(f"record {index.fqn!r} is in {path}, which the checkpoint does not list")
            if info.offset + info.length > files[path]:
                raise ValueError(f"record {index.fqn!r} ends after the end of {path}")


def parse_metadata(data: bytes, files: Mapping[str, int] | None = None) -> Any:
    """DCP's ``Metadata`` in *data* (a ``.metadata`` file's bytes), read without running code
    and checked: every tensor with a dtype, sizes and chunks inside them, every record of every
    chunk and value in a ``__R_N.distcp`` file (with *files*, ``{name: size}``: one of those,
    the record inside it), no storage transforms.

    :raises ValueError: saying what is wrong (an unpickling error's message included).
    """
    try:
        metadata = MetadataUnpickler(io.BytesIO(data)).load()
    except Exception as error:  # whatever a damaged pickle raises: it is not DCP's metadata
        raise ValueError(f"is not DCP metadata: {type(error).__name__}: {error}"[:300]) from None
    try:
        _check(metadata, files)
    except ValueError:
        raise
    except Exception as error:  # a record without one of its fields, a field of another type
        raise ValueError(f"is not DCP metadata: {type(error).__name__}: {error}"[:300]) from None
    return metadata


def _check(metadata: Any, files: Mapping[str, int] | None) -> None:
    if type(metadata) is not _md.Metadata:
        raise ValueError(f"holds a {type(metadata).__name__}, not DCP's Metadata")
    entries = metadata.state_dict_metadata
    if type(entries) is not dict or not all(type(k) is str for k in entries):
        raise ValueError("holds no table of tensors")
    storage = metadata.storage_data
    _check_storage(storage, files)
    for fqn, entry in entries.items():
        if type(entry) is _md.BytesStorageMetadata:
            if _md.MetadataIndex(fqn) not in storage:
                raise ValueError(f"value {fqn!r} has no record in the files")
        elif type(entry) is _md.TensorStorageMetadata:
            _check_tensor(fqn, entry, storage)
        else:
            raise ValueError(f"value {fqn!r} is a {type(entry).__name__}, not a DCP record")
    planner = metadata.planner_data
    if planner is not None and not (
        type(planner) is dict
        and all(type(v) is tuple and all(type(p) in (str, int) for p in v) for v in planner.values())
    ):
        raise ValueError("holds planner data that is not DCP's")
    if metadata.storage_meta is not None and type(metadata.storage_meta) is not _md.StorageMeta:
        raise ValueError("holds storage information that is not DCP's")


def check_values(metadata: Any, directory: str | Path) -> None:
    """Read every value of checkpoint *directory* that is not a tensor (an optimizer's
    hyper-parameters, ...; *metadata* from :func:`parse_metadata`) as :func:`load` reads it,
    without code: a value that only a pickle with code could read is refused before any rank
    loads the checkpoint. They are few and small; the tensors are not read here.

    :raises RecordError: naming the file and the value.
    """
    for fqn, entry in metadata.state_dict_metadata.items():
        if type(entry) is not _md.BytesStorageMetadata:
            continue
        info = metadata.storage_data[_md.MetadataIndex(fqn)]
        try:
            with open(Path(directory) / info.relative_path, "rb") as handle:
                handle.seek(info.offset)
                data = handle.read(info.length)
            torch.load(io.BytesIO(data), weights_only=True)
        except Exception as error:
            why = f"{type(error).__name__}: {' '.join(str(error).split())}"
            message = f"value {fqn!r} does not read without code: {why}"
            raise RecordError(info.relative_path, message[:300]) from None


# -- readers and planners ------------------------------------------------------------------------


class _DamageError(Exception):
    """Raised inside DCP by the safe reader: the files, not the model, are at fault."""


def _read_bounded(stream: Any, limit: int) -> bytes:
    """At most *limit* bytes of *stream*, read in pieces (``read(limit)`` would allocate *limit*
    bytes at once, whatever the file's size)."""
    pieces, size = [], 0
    while size < limit and (piece := stream.read(min(1 << 20, limit - size))):
        pieces.append(piece)
        size += len(piece)
    return b"".join(pieces)


class _SafeReading:
    """What the safe readers change in DCP's: ``.metadata`` read by :func:`parse_metadata` (the
    coordinator's only: never a rank's own ``__R.metadata``), every record's read failure
    marked as the files' fault."""

    path: Any
    fs: Any
    load_id: str
    #: why the files could not be read (None: they could, so far).
    damage: str | None = None
    #: the same, when they could not be reached at all (missing, a store's error): not damage.
    unreadable: str | None = None

    def read_metadata(self) -> Any:  # no **kwargs: DCP then never falls back to a rank's own file
        try:
            with self.fs.create_stream(self.fs.concat_path(self.path, METADATA), "rb") as stream:
                data = _read_bounded(stream, MAX_METADATA_BYTES + 1)
        except Exception as error:  # missing, or the store cannot be reached: not damage
            why = " ".join(str(error).split())
            self.damage = self.unreadable = f"{METADATA} cannot be read: {type(error).__name__}: {why}"
            raise _DamageError(self.damage) from None
        try:
            if len(data) > MAX_METADATA_BYTES:
                raise ValueError(f"is larger than {MAX_METADATA_BYTES} bytes")
            metadata = parse_metadata(data)
        except ValueError as error:
            self.damage = f"{METADATA} {error}"
            raise _DamageError(self.damage) from None
        if metadata.storage_meta is None:
            metadata.storage_meta = _md.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: Any, planner: Any) -> Any:
        try:
            return super().read_data(plan, planner)  # type: ignore[misc]
        except Exception as error:
            records = getattr(self, "storage_data", None) or {}
            files = (getattr(records.get(item.storage_index), "relative_path", "") for item in plan.items)
            names = sorted({str(name) for name in files})
            where = ", ".join(n for n in names if n) or "a record"
            self.damage = f"{where} does not read: {type(error).__name__}: {' '.join(str(error).split())}"
            raise _DamageError(self.damage) from None


class SafeFileSystemReader(_SafeReading, FileSystemReader):
    """DCP's ``FileSystemReader`` reading no code (:class:`_SafeReading`)."""


def _fsspec_reader() -> type:
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader  # private in torch 2.13

    class SafeFsspecReader(_SafeReading, FsspecReader):
        """DCP's ``FsspecReader`` reading no code."""

    return SafeFsspecReader


def reader(path: str | Path, storage_options: Mapping[str, Any] | None = None) -> Any:
    """A safe DCP reader of checkpoint directory *path* (an fsspec URL: with *storage_options*)."""
    if "://" in str(path):
        return _fsspec_reader()(str(path), **dict(storage_options or {}))
    return SafeFileSystemReader(str(path))


class _SafeBytes:
    """A load planner's values (everything not a tensor) read by ``torch.load(weights_only=True)``."""

    flatten_state_dict: bool
    original_state_dict: Any
    state_dict: Any
    mappings: Any

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        from torch.distributed.checkpoint._traverse import set_element

        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


class SafeLoadPlanner(_SafeBytes, DefaultLoadPlanner):
    """DCP's default load planner, its values read without code."""


class SafeEmptyPlanner(_SafeBytes, _EmptyStateDictLoadPlanner):
    """DCP's planner that builds the state from the metadata (one process reads it all), its
    values read without code."""


# -- errors and DCP's log --------------------------------------------------------------------------

_quiet_lock = threading.Lock()
_quiet_count = 0


class _DropDCPRecords(logging.Filter):
    """DCP logs on Python's root logger ("Global metadata is not found", with a traceback)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "torch/distributed/checkpoint" not in record.pathname.replace("\\", "/")


_filter = _DropDCPRecords()


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Keep DCP's log records (root logger) and its note that one process works alone off stderr."""
    global _quiet_count
    root = logging.getLogger()
    with _quiet_lock:
        if _quiet_count == 0:
            root.addFilter(_filter)
        _quiet_count += 1
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "torch.distributed is ", UserWarning)
            yield
    finally:
        with _quiet_lock:
            _quiet_count -= 1
            if _quiet_count == 0:
                root.removeFilter(_filter)


def _causes(error: BaseException) -> list[BaseException]:
    """The per-rank errors inside a ``CheckpointException`` (or *error* itself)."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, Mapping) and failures:
        found = []
        for failure in failures.values():
            cause = failure[0] if isinstance(failure, tuple) else getattr(failure, "exc", failure)
            found.append(cause if isinstance(cause, BaseException) else error)
        return found
    return [error]


def raise_translated(error: BaseException, where: str, source: Any = None) -> None:
    """Raise one :class:`DamagedShardsError` or :class:`ShardsMismatchError` for *error* (from a
    DCP load of checkpoint *where*; *source*, the reader, says whether its files were at fault).

    :raises DamagedShardsError: the files could not be read (a record, ``.metadata``), or
        could not be reached (said so: a missing ``.metadata``, a store's error).
    :raises ShardsMismatchError: otherwise: the files do not fit the model.
    """
    damage = getattr(source, "damage", None)
    if damage is None:
        damage = next((str(c) for c in _causes(error) if isinstance(c, _DamageError)), None)
    if damage is not None:
        state = "cannot be read" if getattr(source, "unreadable", None) else "is damaged"
        raise DamagedShardsError(f"the sharded checkpoint {where!r} {state}: {damage:.400}") from None
    why = one_line(error)
    where = f"the sharded checkpoint {where!r}"
    raise ShardsMismatchError(f"{where} does not fit the model: {why:.500}") from None


def one_line(error: BaseException) -> str:
    """*error* in one line: a ``CheckpointException``'s per-rank errors without their tracebacks."""
    causes = _causes(error)
    return "; ".join(dict.fromkeys(f"{type(c).__name__}: {' '.join(str(c).split())}" for c in causes))


def checkpoint_exception() -> type[BaseException]:
    """torch's ``CheckpointException`` (a ``BaseException``: catch it beside ``Exception``)."""
    from torch.distributed.checkpoint.api import CheckpointException

    return CheckpointException


def load(
    state: dict[str, Any],
    path: str | Path,
    storage_options: Mapping[str, Any] | None = None,
    no_dist: bool = False,
) -> None:
    """``dcp.load(state)`` from checkpoint *path* (an fsspec URL with *storage_options*), reading
    no code, quietly; one error on failure (:func:`raise_translated`).

    The reader is given without ``checkpoint_id``: DCP would reset it with the id alone and
    rebuild an fsspec filesystem without *storage_options* (the default endpoint)."""
    import torch.distributed.checkpoint as dcp

    source = reader(path, storage_options)
    try:
        with quiet():
            dcp.load(state, storage_reader=source, planner=SafeLoadPlanner(), no_dist=no_dist)
    except (Exception, checkpoint_exception()) as error:
        raise_translated(error, str(path), source)


def consolidated(path: str | Path, keys: set[str] | None = None) -> dict[str, Any]:
    """Every value of checkpoint *path* under *keys* (all: None) read by this process alone, whole
    (no process group; also inside a run on several processes, whose collectives it leaves alone)."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    loaded: dict[str, Any] = {}
    source = reader(path)
    try:
        with quiet():
            _load_state_dict(loaded, source, no_dist=True, planner=SafeEmptyPlanner(keys=keys))
    except (Exception, checkpoint_exception()) as error:
        raise_translated(error, str(path), source)
    return loaded
