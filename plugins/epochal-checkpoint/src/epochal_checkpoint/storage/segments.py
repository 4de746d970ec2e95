"""The training log's segments: immutable files of rows, linked, merged and read back.

A segment ``log-<sequence>-i<first>-<last>.json`` holds JSON ``{"<iteration>": {key: value}}``
rows; a checkpoint reads its segments in the manifest's ``log_segments`` order, a later
segment's row replacing an earlier one's (``{}``: the row was emptied). The next checkpoint of
a run hard-links the previous one's segments (:class:`LinkedSegment`) and writes one new
segment (:class:`NewSegment`), or a merge of earlier segments' bytes and the new rows
(:class:`MergedSegment`); :mod:`~epochal_checkpoint.storage.write` puts them on disk.

Reading (:func:`read_segments`): a damaged segment costs only its rows. A segment missing
from a checkpoint, or failing its checksum there, is taken from another checkpoint of the same
directory holding a file of that name with the same size and CRC-32 (its hard link from an
earlier save): the rows are not lost.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from epochal_checkpoint.errors import CorruptCheckpointError
from epochal_checkpoint.storage.codec import DATA, FORMAT, SEGMENTS
from epochal_checkpoint.storage.layout import NAME_RE
from epochal_checkpoint.storage.read import SEGMENT_RE, corrupt, parse_json, verified

__all__ = [
    "LOG_FORMAT",
    "SEGMENT_HEAD",
    "SEGMENT_RE",
    "LinkedSegment",
    "MergedSegment",
    "NewSegment",
    "Segment",
    "encode_segment",
    "merged_pieces",
    "read_segments",
    "rows_ok",
    "segment_name",
]

LOG_FORMAT = f"{FORMAT}-log"
#: every segment starts with these bytes and ends with ``}}`` (see :func:`encode_segment`).
SEGMENT_HEAD = b'{"format":"' + LOG_FORMAT.encode("ascii") + b'","version":1,"rows":{'
_ROW_KEY = re.compile(r"^\d{1,18}$")


def segment_name(sequence: int, rows: Iterable[int]) -> str:
    """The file name of a log segment written by save *sequence* holding rows *rows*."""
    ids = list(rows)
    return f"log-{sequence:06d}-i{min(ids, default=0):06d}-{max(ids, default=0):06d}.json"


@dataclass
class Segment:
    """A log segment file of a checkpoint: name, size, CRC-32 and the iterations of its rows."""

    name: str
    size: int
    crc32: str
    rows: list[int]
    #: the checkpoint holding the bytes when not the one listing it (None: that one): a copy
    #: taken from another checkpoint because the listing one lost its own.
    origin: Path | None = None
    #: its HMAC under the signing key, once known (a save that links it need not read it).
    mac: str | None = None


@dataclass
class NewSegment:
    """A log segment to write: its name and the rows (a JSON-able tree from ``flatten``)."""

    name: str
    rows: dict[str, Any]


@dataclass
class LinkedSegment:
    """A segment of the checkpoint *source* to hard-link (or copy) into a new checkpoint."""

    source: Path
    segment: Segment

    @property
    def where(self) -> Path:
        """The checkpoint directory holding the segment's bytes."""
        return self.segment.origin or self.source


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


def encode_segment(rows: Mapping[str, Any]) -> bytes:
    """The bytes of a log segment holding *rows* (``{"<iteration>": {key: value}}``)."""
    document = {"format": LOG_FORMAT, "version": 1, "rows": rows}
    return json.dumps(document, separators=(",", ":"), allow_nan=True).encode("ascii")


def rows_ok(rows: Any) -> bool:
    """Whether *rows* is a table of ``{"<iteration>": {key: value}}``."""
    return isinstance(rows, dict) and all(isinstance(r, dict) and _ROW_KEY.match(k) for k, r in rows.items())


def _body(part: LinkedSegment, reload: Callable[[Segment], Mapping[str, Any]]) -> memoryview:
    """The rows of segment *part* as the bytes between ``"rows":{`` and ``}}`` (its own bytes,
    verified; its rows re-encoded from ``reload`` when it fails verification)."""
    segment = part.segment
    data: bytes | bytearray
    try:
        data = verified(part.where, segment.name, {"size": segment.size, "crc32": segment.crc32})
    except CorruptCheckpointError:
        data = encode_segment(reload(segment))
    if not (data.startswith(SEGMENT_HEAD) and data.endswith(b"}}")):  # not our encoding: parse it
        try:
            document = parse_json(part.where, segment.name, data)
        except CorruptCheckpointError:
            document = None
        rows: Any = document.get("rows") if isinstance(document, dict) else None
        data = encode_segment(rows if rows_ok(rows) else reload(segment))
    return memoryview(data)[len(SEGMENT_HEAD) : -2]


def merged_pieces(source: MergedSegment) -> tuple[list[memoryview | bytes], list[int]]:
    """The bytes of the merged segment *source* (in pieces, none copied twice) and its rows."""
    bodies = [body for part in source.parts if len(body := _body(part, source.reload))]
    new = memoryview(encode_segment(source.rows))[len(SEGMENT_HEAD) : -2]
    if len(new):
        bodies.append(new)
    pieces: list[memoryview | bytes] = [SEGMENT_HEAD]
    for k, body in enumerate(bodies):
        pieces += [b",", body] if k else [body]
    pieces.append(b"}}")
    ids: set[int] = {int(i) for i in source.rows}
    for part in source.parts:
        ids.update(part.segment.rows)
    return pieces, sorted(ids)


def _intact_copy(path: Path, name: str, expected: Mapping[str, Any]) -> tuple[Path, bytearray] | None:
    """Segment *name* from another checkpoint beside *path* whose file of that name has the
    size and CRC-32 *expected* (the newest such checkpoint first), or None."""
    try:
        entries = sorted(os.scandir(path.parent), key=lambda entry: entry.name, reverse=True)
    except OSError:
        return None
    for entry in entries:
        if entry.name == path.name or not NAME_RE.match(entry.name):
            continue
        if not entry.is_dir(follow_symlinks=False) or not os.path.lexists(os.path.join(entry.path, name)):
            continue
        try:
            return Path(entry.path), verified(Path(entry.path), name, expected)
        except CorruptCheckpointError:
            continue
    return None


def _rows_of(path: Path, name: str, data: bytes | bytearray) -> dict[str, Any]:
    document = parse_json(path, name, data)
    rows: Any = document.get("rows") if isinstance(document, dict) else None
    if not isinstance(document, dict) or document.get("format") != LOG_FORMAT:
        raise corrupt(path, name, "is not a log segment (key format)")
    if not rows_ok(rows):
        raise corrupt(path, name, "key rows is not a table of {iteration: row}")
    return rows


def read_segments(
    path: Path,
    manifest: Mapping[str, Any],
    tree: dict[str, Any],
    check: Callable[[str, bytearray], None] | None = None,
) -> tuple[list[Segment], list[int], list[tuple[str, str]]]:
    """Read the log segments of *manifest* into ``tree["log"]["rows"]`` (rows in iteration order).

    Return the segments read, the rows found in the state and the damaged segments with why. A
    damaged segment costs only its rows: the others and the rest of the state are used. A
    segment whose file here is missing or fails its checksum is read from an intact copy in
    another checkpoint of the directory (:attr:`Segment.origin` names it). *check*, when given,
    is called with each segment's name and bytes before its rows are parsed (the signature
    check); a segment it refuses counts as damaged.
    """
    names = manifest.get(SEGMENTS, [])
    if not names:
        return [], [], []
    log: Any = tree.get("log")
    inline: Any = log.get("rows") if isinstance(log, dict) else None
    if not isinstance(inline, dict):
        raise corrupt(path, DATA, "has no log rows (key log.rows) to complete")
    merged: dict[str, Any] = {}
    segments = []
    damaged: list[tuple[str, str]] = []
    for name in names:
        expected = manifest["files"][name]
        origin: Path | None = None
        try:
            try:
                data = verified(path, name, expected)
                if check is not None:
                    check(name, data)
            except CorruptCheckpointError:
                copy = _intact_copy(path, name, expected)
                if copy is None:
                    raise
                origin, data = copy
                if check is not None:
                    check(name, data)
            rows = _rows_of(origin or path, name, data)
        except CorruptCheckpointError as error:
            damaged.append((name, str(error)))
            continue
        segments.append(Segment(name, expected["size"], expected["crc32"], [int(i) for i in rows], origin))
        merged.update(rows)
    if not rows_ok(inline):
        raise corrupt(path, DATA, "key log.rows is not a table of {iteration: row}")
    merged.update(inline)
    inline_rows = [int(i) for i in inline]
    log["rows"] = {i: merged[i] for i in sorted(merged, key=int) if merged[i]}
    return segments, inline_rows, damaged
