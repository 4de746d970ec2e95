"""Incremental saves of the training log: which rows a checkpoint writes, which segments it links.

The log's rows go into immutable segment files (see :mod:`epochal_checkpoint.storage`). A save
compares every row the previous complete checkpoint of this run holds with a copy kept from
that save (``map`` over the rows: C speed, no encoding), takes the rows created since and the
rows that were empty (or kept in ``state.json``) then, and writes only the new and changed rows
into one new segment; the previous checkpoint's segments are hard-linked. So a save costs what
changed plus one C-speed comparison per row, not the re-encoding of the whole history.

To keep the number of segments small, the new segment also takes in (re-encodes from the log)
the newest segments when :data:`FANOUT` - 1 of them at its tail are not larger than it (by
powers of :data:`FANOUT` rows), like an LSM tree: a checkpoint has at most about
``(FANOUT - 1) * log_FANOUT(rows)`` segments, and each row is re-encoded about
``log_FANOUT(rows)`` times over a run.
"""

from __future__ import annotations

import copy
import itertools
import operator
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from epochal.log import plain_row
from epochal_checkpoint import storage

if TYPE_CHECKING:
    from epochal.log import TrainingLog

#: segments fold into the new one when FANOUT - 1 at the tail are not larger than it.
FANOUT = 8
_FANOUT_BITS = FANOUT.bit_length() - 1
_MUTABLE = (list, dict)
#: row values JSON holds exactly and that cannot change in place: such rows skip flatten().
_PLAIN = frozenset({float, str, bool, type(None), int})
_STR = frozenset({str})


def _is_plain(row: Mapping[str, Any]) -> bool:
    """Whether *row* holds only str keys and immutable JSON values (``map``: C speed)."""
    types = set(map(type, row.values()))
    if not types <= _PLAIN or not set(map(type, row)) <= _STR:
        return False
    return int not in types or all(
        v.bit_length() <= storage.BIG_INT_BITS for v in row.values() if type(v) is int
    )


def level(rows: int) -> int:
    """The size class of a segment of *rows* rows: floor(log_FANOUT(rows)) (0 for 0 or 1 row)."""
    return (max(rows, 1).bit_length() - 1) // _FANOUT_BITS


@dataclass
class LogBase:
    """The log as the newest complete checkpoint of this run holds it."""

    #: that checkpoint (None until the write completed).
    path: Path | None
    #: its segments, in reading order.
    segments: list[storage.Segment]
    #: every non-empty row whose newest version is in ``segments``, as saved (plain copies).
    saved: dict[int, dict[str, Any]]
    #: ``len(log.row_map)`` at that save: rows created after are past it.
    seen: int
    #: ``log.load_count`` at that save (a load replaces the rows: start over).
    loads: int
    #: rows that were empty at that save, or kept in ``state.json``: looked at again.
    recheck: list[int] = field(default_factory=list)


@dataclass
class LogSave:
    """What one save writes of the log."""

    #: rows kept in ``state.json`` (values that plain JSON cannot hold: nested numpy, huge ints).
    inline: dict[str, Any]
    #: the previous checkpoint's segments to link, in order.
    linked: list[storage.LinkedSegment]
    #: the new segment (None: nothing new or changed).
    new: storage.NewSegment | None
    #: the base after this save; its ``path``/``segments`` are set once the write completed.
    base: LogBase

    def sources(self) -> list[storage.LinkedSegment | storage.NewSegment]:
        """The segments of the checkpoint, in reading order."""
        return [*self.linked, *([self.new] if self.new is not None else [])]


def _same(saved: Mapping[str, Any], row: Mapping[str, Any] | None) -> bool:
    if row is None or len(saved) != len(row):
        return False
    try:
        return bool(saved == row)
    except Exception:  # a value whose == is not a bool (a numpy array): treat it as changed
        return False


def _changed(saved: dict[int, dict[str, Any]], rows: Mapping[int, dict[str, Any]]) -> list[int]:
    """The saved rows that differ from the log's now (C speed: ``map`` and ``compress``)."""
    keys = saved.keys()
    try:
        return list(itertools.compress(keys, map(operator.ne, saved.values(), map(rows.get, keys))))
    except Exception:  # some == raised (an array in a row): row by row
        return [i for i, row in saved.items() if not _same(row, rows.get(i))]


def plan(log: TrainingLog, base: LogBase | None, sequence: int) -> LogSave:
    """Decide what save *sequence* writes of *log*, given the newest complete checkpoint's *base*.

    Nothing is changed: the returned :attr:`LogSave.base` is a new object (sharing the old
    ``saved`` dict, updated in place: the old base must not be used after this call).

    :raises UnsupportedStateError: for a row value that cannot be saved, naming its key path.
    """
    rows = log.row_map
    usable = (
        base is not None and base.path is not None and base.loads == log.load_count and base.path.is_dir()
    )
    if base is None or not usable:
        saved: dict[int, dict[str, Any]] = {}
        kept: list[storage.Segment] = []
        write: set[int] = set(rows)
        shadow: set[int] = set()
    else:
        saved, kept = base.saved, list(base.segments)
        write = set(_changed(saved, rows))
        shadow = set(write)  # rows on disk: written even when emptied (an empty row hides them)
        write.update(itertools.islice(rows, base.seen, None))
        write.update(base.recheck)
    size = level(len(write))
    while kept:
        tail = 0
        while tail < len(kept) and level(len(kept[-1 - tail].rows)) <= size:
            tail += 1
        if tail < FANOUT - 1:
            break
        for segment in kept[-tail:]:
            write.update(segment.rows)
            shadow.update(segment.rows)
        del kept[-tail:]
        size = level(len(write))
    flat: dict[str, Any] = {}  # the new segment's rows, in iteration order
    other: dict[str, Any] = {}  # rows with containers or numpy values: through flatten()
    recheck: list[int] = []
    for i in sorted(write):
        row = rows.get(i)
        if row:
            if _is_plain(row):  # the common case: a copy at C speed
                flat[str(i)] = dict(row)  # also the copy kept to compare with
            else:
                flat[str(i)] = plain = plain_row(row)  # numpy values made Python ones
                if not _is_plain(plain):
                    other[str(i)] = plain
        elif i in shadow:
            flat[str(i)] = {}
        if row is not None and not row:
            recheck.append(i)
    inline: dict[str, Any] = {}
    if other:
        snapshot = storage.flatten({"log": {"rows": other}})
        flat.update(snapshot.tree["log"]["rows"])  # rebuilt containers: copies the log cannot change
        for entry in (*snapshot.index, *snapshot.ints):
            key = entry["path"][2]
            if key not in inline:  # not plain JSON: kept in state.json (read after the segments)
                inline[key] = other[key]
                del flat[key]
                recheck.append(int(key))
    for key, row in flat.items():
        if row:
            saved[int(key)] = row
        else:
            saved.pop(int(key), None)
    for key in inline:
        saved.pop(int(key), None)
    new = storage.NewSegment(storage.segment_name(sequence, map(int, flat)), flat) if flat else None
    linked = [storage.LinkedSegment(base.path, s) for s in kept] if base is not None and base.path else []
    return LogSave(inline, linked, new, LogBase(None, [], saved, len(rows), log.load_count, recheck))


def resumed_base(
    log: TrainingLog, info: storage.CheckpointInfo, rows: Mapping[str, dict[str, Any]]
) -> LogBase | None:
    """The base of a run resumed from checkpoint *info*, whose state's log rows were *rows*.

    Called after the loop loaded that state (``log.load_count`` counts it); the rows of the state
    are the ones the loop copied into the log, in the same order.
    """
    if info.segments is None or log.load_count == 0:
        return None
    inline = set(info.inline_rows)
    on_disk: set[int] = set().union(*(s.rows for s in info.segments))
    saved = {}
    recheck = sorted(inline)
    for key, row in rows.items():
        i = int(key)
        if i in inline or i not in on_disk:
            if i not in inline:
                recheck.append(i)
            continue
        mutable = any(type(v) in _MUTABLE for v in row.values())
        saved[i] = copy.deepcopy(row) if mutable else dict(row)
    return LogBase(info.path, list(info.segments), saved, len(rows), log.load_count, recheck)
