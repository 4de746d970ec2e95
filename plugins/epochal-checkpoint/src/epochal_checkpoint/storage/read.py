"""Bounded reads of a checkpoint's files, their verification, and the manifest's check.

Every reader is bounded: a file is looked at with ``lstat`` before it is opened (a symbolic
link, a FIFO or a device is refused without opening it), its size is compared with the size
the manifest declares before anything is allocated, JSON is capped in size and depth, and
every value read is type-checked; whatever is wrong ends in a :class:`CorruptCheckpointError`
naming the checkpoint, the file and the key.

The manifest is trusted only once its commit record (its last key: the CRC-32 of every byte
before the record's digits) verifies; a format version other than
:data:`~epochal_checkpoint.storage.codec.FORMAT_VERSION` is one
:class:`ForeignCheckpointError` naming the version found and the one expected.
"""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from epochal_checkpoint.errors import CorruptCheckpointError, ForeignCheckpointError, UnsafeCheckpointError
from epochal_checkpoint.storage.codec import (
    DATA,
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    OWN,
    SEAL_RE,
    SEGMENTS,
    crc32,
)

#: arrays are read (and checksummed while in the cache) in pieces of this many bytes.
READ_CHUNK = 256 << 10
#: reading limits: a file larger than the manifest says is refused before anything is allocated.
MAX_FILE_BYTES = 1 << 40
MAX_MANIFEST_BYTES = 64 << 20
MAX_JSON_DEPTH = 256
MAX_COUNT = 1 << 62
CRC_RE = re.compile(r"^[0-9a-f]{8}$")
#: a log segment's file name (``log-<sequence>-i<first>-<last>.json``).
SEGMENT_RE = re.compile(r"^log-\d+-i\d+-\d+\.json$")


def corrupt(path: Path, name: str, message: str) -> CorruptCheckpointError:
    """The error for file *name* of checkpoint *path*: ``checkpoint '<path>': <name> <message>``."""
    return CorruptCheckpointError(f"checkpoint {str(path)!r}: {name} {message}")


def open_regular(path: Path, name: str, limit: int, size: int | None = None) -> tuple[int, int]:
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
        raise corrupt(path, name, "is missing") from None
    except OSError as error:
        raise corrupt(path, name, f"cannot be read: {error.strerror or error}") from None
    if stat.S_ISLNK(info.st_mode):
        raise corrupt(path, name, "is a symbolic link (checkpoint files never are); refusing to follow it")
    if not stat.S_ISREG(info.st_mode):
        raise corrupt(path, name, "is not a regular file (a FIFO, device or directory); refusing to read it")
    if size is not None and info.st_size != size:
        raise corrupt(
            path, name, f"has {info.st_size} bytes, the manifest says {size} (truncated or overwritten)"
        )
    if info.st_size > limit:
        raise corrupt(path, name, f"has {info.st_size} bytes, more than the {limit} allowed")
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(file, flags | getattr(os, "O_CLOEXEC", 0))
    except OSError as error:
        raise corrupt(path, name, f"cannot be read: {error.strerror or error}") from None
    try:
        opened = os.fstat(fd)
    except OSError as error:
        os.close(fd)
        raise corrupt(path, name, f"cannot be read: {error.strerror or error}") from None
    if not stat.S_ISREG(opened.st_mode) or opened.st_size != info.st_size:
        os.close(fd)
        raise corrupt(path, name, "changed while it was opened; refusing to read it")
    return fd, info.st_size


def read_into(path: Path, name: str, fd: int, view: memoryview, offset: int, crc: int = 0) -> int:
    """Fill *view* from *fd* at *offset*, in pieces checksummed while in the cache; return the
    CRC-32 (continued from *crc*) of what was read."""
    got, size = 0, view.nbytes
    try:
        while got < size:
            n = os.preadv(fd, [view[got : got + READ_CHUNK]], offset + got)
            if n == 0:
                raise corrupt(path, name, "changed size while it was read")
            crc = crc32(view[got : got + n], crc)
            got += n
    except OSError as error:
        raise corrupt(path, name, f"cannot be read: {error.strerror or error}") from None
    return crc


def read_regular(path: Path, name: str, limit: int, size: int | None = None) -> bytearray:
    """The bytes of regular file *name* in *path*, refusing links, FIFOs, devices, odd sizes.

    See :func:`open_regular`; the file is read to exactly its size (growth is detected).

    :raises CorruptCheckpointError: naming *path* and *name*.
    """
    fd, length = open_regular(path, name, limit, size)
    try:
        data = bytearray(length)
        read_into(path, name, fd, memoryview(data), 0)
        try:
            grown = os.pread(fd, 1, length)
        except OSError as error:
            raise corrupt(path, name, f"cannot be read: {error.strerror or error}") from None
        if grown:
            raise corrupt(path, name, "changed size while it was read")
    finally:
        os.close(fd)
    return data


def verified(path: Path, name: str, expected: Mapping[str, Any]) -> bytearray:
    """Read file *name* of checkpoint *path*; check its size (first) and CRC-32."""
    data = read_regular(path, name, MAX_FILE_BYTES, expected["size"])
    crc = f"{crc32(data):08x}"
    if crc != expected["crc32"]:
        raise corrupt(path, name, f"fails its checksum (crc32 {crc}, manifest {expected['crc32']})")
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
        raise corrupt(path, name, f"nests deeper than {depth} levels") from None
    except (ValueError, UnicodeDecodeError) as error:
        raise corrupt(path, name, f"is not valid JSON ({str(error)[:200]})") from None
    if not _depth_ok(value, depth):
        raise corrupt(path, name, f"nests deeper than {depth} levels")
    return value


def is_int(value: Any, low: int = 0, high: int = MAX_COUNT) -> bool:
    """Whether *value* is an int (not a bool) within ``[low, high]``."""
    return type(value) is int and low <= value <= high


def _check_file_entry(path: Path, key: str, entry: Any) -> None:
    if not (
        isinstance(entry, dict)
        and is_int(entry.get("size"), 0, MAX_FILE_BYTES)
        and isinstance(entry.get("crc32"), str)
        and CRC_RE.match(entry["crc32"])
    ):
        raise corrupt(
            path, MANIFEST, f"key files.{key} is not {{size: int, crc32: 8 hex digits}}: {entry!r:.100}"
        )


def check_manifest(path: Path, manifest: Any) -> dict[str, Any]:
    """Check the keys and types of a parsed manifest; return it.

    :raises ForeignCheckpointError: another format, or a format version other than
        :data:`FORMAT_VERSION` (older or newer), naming the version found and the one expected.
    :raises CorruptCheckpointError: a key missing or of the wrong type, naming it.
    """
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ForeignCheckpointError(
            f"{str(path)!r} is not an epochal checkpoint ({MANIFEST} of another format)"
        )
    version = manifest.get("version")
    if type(version) is not int or version != FORMAT_VERSION:
        hint = (
            "written by a development version before 0.1.0, never released; not read"
            if type(version) is int and 0 < version < FORMAT_VERSION
            else "upgrade epochal-checkpoint"
        )
        raise ForeignCheckpointError(
            f"checkpoint {str(path)!r} has format version {version!r:.40}; this epochal-checkpoint "
            f"reads format version {FORMAT_VERSION} ({hint})"
        )

    def bad(key: str, what: str) -> CorruptCheckpointError:
        return corrupt(path, MANIFEST, f"key {key} is not {what}: {manifest.get(key)!r:.100}")

    for key in ("sequence", "saved_at_ns", "epoch", "iteration"):
        # sequence and save time order the checkpoints: a missing one would rank a checkpoint
        # silently as the oldest, so that it is never read, never reported
        required = key in ("sequence", "saved_at_ns")
        if (key in manifest or required) and not is_int(manifest.get(key)):
            raise bad(key, "a non-negative integer")
    for key in ("run_id", "name", "reason"):
        if (key in manifest or key == "name") and not isinstance(manifest.get(key), str):
            raise bad(key, "a string")
    for key in ("lineage", OWN):
        value = manifest.get(key, [])
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise bad(key, "a list of strings")
    metric = manifest.get("metric")
    if metric is not None and (type(metric) not in (int, float)):
        raise bad("metric", "a number or null")
    if "plugins" in manifest and not isinstance(manifest["plugins"], dict):
        raise bad("plugins", "a table")
    segments = manifest.get(SEGMENTS, [])
    if (
        not isinstance(segments, list)
        or not all(isinstance(n, str) and SEGMENT_RE.match(n) for n in segments)
        or len(set(segments)) != len(segments)
    ):
        raise corrupt(path, MANIFEST, f"has a bad {SEGMENTS} list")
    from epochal_checkpoint.storage.sharded import SHARDED, check_names  # it reads files with this module

    files = manifest.get("files")
    expected = {DATA, *segments, *check_names(path, manifest.get(SHARDED, []))}
    if not isinstance(files, dict) or set(files) != expected:
        listed = sorted(files) if isinstance(files, dict) else files
        raise corrupt(path, MANIFEST, f"lists files {listed!r:.200}, expected {sorted(expected)!r:.200}")
    for key, entry in files.items():
        _check_file_entry(path, key, entry)
    if not is_int(files[DATA].get("state"), 0, files[DATA]["size"]):
        raise corrupt(path, MANIFEST, f"key files.{DATA}.state is not an offset within the file")
    return manifest


def read_manifest(path: Path, verify: Callable[[bytearray], None] | None = None) -> dict[str, Any]:
    """Read ``<path>/manifest.json``, check its commit record (its last key) and its keys.

    *verify*, when given, is called with the manifest's bytes before anything else looks at
    them (the signature check: :mod:`~epochal_checkpoint.storage.sign`).

    :raises ForeignCheckpointError: if *path* has no manifest, or one of another format or version.
    :raises CorruptCheckpointError: if the manifest is damaged or was never committed, naming why.
    """
    try:
        os.lstat(path / MANIFEST)
    except FileNotFoundError:
        raise ForeignCheckpointError(
            f"{str(path)!r} is not an epochal checkpoint (no {MANIFEST}; an incomplete or foreign directory)"
        ) from None
    except OSError:
        pass  # read_regular names the problem
    data = read_regular(path, MANIFEST, MAX_MANIFEST_BYTES)
    if verify is not None:
        verify(data)
    sealed = SEAL_RE.search(data, max(len(data) - 64, 0))
    if sealed is not None and f"{crc32(memoryview(data)[: sealed.start(1)]):08x}" != sealed[1].decode():
        raise corrupt(path, MANIFEST, "fails its checksum (its commit record does not match)")
    manifest = check_manifest(path, parse_json(path, MANIFEST, data, depth=8))
    if "commit" in manifest and sealed is None:
        raise corrupt(path, MANIFEST, "has a damaged commit record (key commit)")
    manifest.pop("commit", None)
    if sealed is None:
        raise corrupt(path, MANIFEST, "has no commit record (the checkpoint was never committed)")
    return manifest


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
