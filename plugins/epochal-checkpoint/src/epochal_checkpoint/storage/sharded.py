"""The files of a sharded checkpoint that torch.distributed.checkpoint (DCP) writes.

A sharded checkpoint is a checkpoint directory like the others (``data.bin``, log segments,
``manifest.json``) that also holds DCP's files, written by every rank in parallel: each rank's
``__<rank>_<n>.distcp`` and the coordinator's ``.metadata``. Their names are listed in the
manifest under :data:`SHARDED` and their sizes and CRC-32s under ``files``, like every other
file: the manifest (its commit record last, written by rank 0 only after every rank reported
its files durable) is what makes the checkpoint complete.

Each rank checksums and fsyncs its own files (:func:`describe`), so that work is parallel too;
a reader verifies them all (:func:`verify`) before any rank loads them, and reads ``.metadata``
(a pickle, in DCP's format) with an unpickler that admits only DCP's metadata records: nothing in
a checkpoint runs code.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from epochal_checkpoint.storage import sign
from epochal_checkpoint.storage.codec import MANIFEST, crc32
from epochal_checkpoint.storage.read import MAX_FILE_BYTES, corrupt, open_regular, read_into, verified

__all__ = ["DCP_METADATA", "SHARDED", "SHARD_RE", "check_metadata", "check_names", "describe", "verify"]

#: the manifest key listing DCP's files.
SHARDED = "sharded"
DCP_METADATA = ".metadata"
SHARD_RE = re.compile(r"^(?:\.metadata|__\d{1,6}_\d{1,6}\.distcp)$")
_CHUNK = 1 << 24


def _entry(path: Path, key: bytes | None) -> dict[str, Any]:
    """Size and CRC-32 of file *path* (with *key*, its HMAC too), read in chunks; the file is
    fsynced on the way."""
    crc, size = 0, 0
    mac = sign.new_mac(key, path.name) if key is not None else None
    fd = os.open(path, os.O_RDONLY)
    try:
        while chunk := os.read(fd, _CHUNK):
            crc = crc32(chunk, crc)
            size += len(chunk)
            if mac is not None:
                mac.update(chunk)
        os.fsync(fd)
    finally:
        os.close(fd)
    return {"size": size, "crc32": f"{crc:08x}", **({"mac": mac.hexdigest()} if mac is not None else {})}


def describe(directory: Path, rank: int, coordinator: bool) -> dict[str, dict[str, Any]]:
    """``{name: {size, crc32}}`` of the DCP files rank *rank* wrote into *directory* (with
    *coordinator*, also ``.metadata``), each fsynced: durable once this returns. With
    ``EPOCHAL_CHECKPOINT_KEY`` set on this rank, each entry also holds the file's ``mac``
    (HMAC-SHA256, for ``signature.json``): every rank signs its own files in parallel."""
    names = sorted(n for n in os.listdir(directory) if n.startswith(f"__{rank}_") and SHARD_RE.match(n))
    if coordinator:
        names.append(DCP_METADATA)
    key = sign.signing_key()
    return {name: _entry(directory / name, key) for name in names}


def check_names(path: Path, names: Any) -> list[str]:
    """The manifest's list of DCP files, checked (names DCP writes, no path, no duplicates).

    :raises CorruptCheckpointError: naming the manifest.
    """
    if (
        not isinstance(names, list)
        or not all(isinstance(n, str) and SHARD_RE.match(n) for n in names)
        or len(set(names)) != len(names)
        or (names and DCP_METADATA not in names)
    ):
        raise corrupt(path, MANIFEST, f"has a bad {SHARDED} list: {names!r:.200}")
    return names


def verify(
    path: Path,
    names: Sequence[str],
    files: Mapping[str, Mapping[str, Any]],
    signed: tuple[bytes, dict[str, str]] | None = None,
) -> None:
    """Check each DCP file of checkpoint *path* against the manifest: regular, its size, its
    CRC-32 (with *signed*, ``(key, signature)``, its HMAC too); then ``.metadata``, read as DCP's
    metadata without running code (:func:`check_metadata`), once everything it points into
    verified.

    :raises CorruptCheckpointError: naming the checkpoint and the file (missing, short, changed,
        not DCP's metadata).
    :raises UnsignedCheckpointError: with *signed*, a file that does not match its signature.
    """
    for name in names:
        if name == DCP_METADATA:
            continue
        expected = files[name]
        fd, size = open_regular(path, name, MAX_FILE_BYTES, expected["size"])
        mac = sign.new_mac(signed[0], name) if signed is not None else None
        try:
            crc, at = 0, 0
            buffer = bytearray(min(_CHUNK, max(size, 1)))
            while at < size:
                view = memoryview(buffer)[: min(_CHUNK, size - at)]
                crc = read_into(path, name, fd, view, at, crc)
                if mac is not None:
                    mac.update(view)
                at += view.nbytes
        finally:
            os.close(fd)
        if f"{crc:08x}" != expected["crc32"]:
            raise corrupt(path, name, f"fails its checksum (crc32 {crc:08x}, manifest {expected['crc32']})")
        if signed is not None and mac is not None:
            sign.compare(path, name, signed[1], mac.hexdigest())
    if DCP_METADATA in names:
        data = verified(path, DCP_METADATA, files[DCP_METADATA])
        if signed is not None:  # before a byte of it is parsed
            sign.check_file(path, DCP_METADATA, data, *signed)
        check_metadata(path, data, names, files)


def check_metadata(
    path: Path, data: bytes | bytearray, names: Sequence[str], files: Mapping[str, Mapping[str, Any]]
) -> None:
    """Read DCP's ``.metadata`` (*data*) of checkpoint *path* as torch's reader would, but
    without unpickling anything but DCP's metadata records, and check that every record lies in
    a ``.distcp`` file the manifest lists, inside its size (:func:`epochal.torch.dcp_io.parse_metadata`),
    and that every value that is not a tensor reads without code (``check_values``).
    Without torch nothing can load the checkpoint's tensors; then only the checksums are checked.

    :raises CorruptCheckpointError: naming the checkpoint and ``.metadata``.
    """
    try:
        from epochal.torch.dcp_io import RecordError, check_values, parse_metadata
    except ImportError:
        return
    sizes = {name: int(files[name]["size"]) for name in names if name != DCP_METADATA}
    try:
        metadata = parse_metadata(bytes(data), sizes)
    except ValueError as error:
        raise corrupt(path, DCP_METADATA, str(error)) from None
    try:
        check_values(metadata, path)
    except RecordError as error:
        raise corrupt(path, error.file, str(error)) from None
