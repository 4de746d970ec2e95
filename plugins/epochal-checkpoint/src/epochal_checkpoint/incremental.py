"""Incremental saves of the training log: which rows a checkpoint writes, which segments it links.

The log's rows go into immutable segment files (see :mod:`epochal_checkpoint.storage.segments`). A save
looks only at the rows that may have changed since the previous complete checkpoint of this
run: the rows resident in the log (compared with copies kept from that save), the rows the log
evicted or read back since (``log.evicted_since``) and a few to recheck. It writes the new and
changed ones into one new segment; the previous checkpoint's segments are hard-linked. So a save
costs what changed plus the log's window, not the history, and the copies kept are bounded by
the window too.

To keep the number of segments small, the new segment also takes in the newest segments when
:data:`FANOUT` - 1 of them at its tail are not larger than it (by powers of :data:`FANOUT`
rows), like an LSM tree: a checkpoint has at most about ``(FANOUT - 1) * log_FANOUT(rows)``
segments, and each row is copied about ``log_FANOUT(rows)`` times over a run. The merge is
done on disk (:class:`epochal_checkpoint.storage.segments.MergedSegment`): the folded segments' bytes
are copied (verified, not parsed) into the new segment before the new rows, so it reads no row
back into memory and costs about a file copy; the log is asked for a folded segment's rows only
when its file fails verification. So the files a save links, and what it costs, stay about flat
over a long run.

While the rows new since the last segment are few (:data:`INLINE_VALUES` values), they stay in
the state instead, as rows that plain JSON cannot hold always do, and the next save looks at them
again: a short run's checkpoints are two files each (``data.bin``, ``manifest.json``), and the
rows go into a segment once enough have gathered.
"""

from __future__ import annotations

import copy
import itertools
import operator
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from epochal.log import plain_row
from epochal_checkpoint.storage.codec import BIG_INT_BITS, flatten
from epochal_checkpoint.storage.segments import (
    LinkedSegment,
    MergedSegment,
    NewSegment,
    Segment,
    segment_name,
)

if TYPE_CHECKING:
    from epochal.log import TrainingLog
    from epochal_checkpoint.storage.layout import CheckpointInfo

#: segments fold into the new one when FANOUT - 1 at the tail are not larger than it.
FANOUT = 8
#: the rows not yet in a segment stay in the state (``data.bin``) while they hold at most this
#: many values: a checkpoint is then two new files, not three (one fsync and one new inode less
#: per save; see bench/README.md, issue 32); each save writes them again, so the bound keeps that
#: cheap (a few tens of microseconds of JSON).
INLINE_VALUES = 256
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
    return int not in types or all(v.bit_length() <= BIG_INT_BITS for v in row.values() if type(v) is int)


def _all_plain(rows: Sequence[Mapping[str, Any]]) -> bool:
    """:func:`_is_plain` for every row of *rows* at once (one pass at C speed over all values)."""
    values = list(itertools.chain.from_iterable(map(_values, rows)))
    types = set(map(type, values))
    if not types <= _PLAIN or not set(map(type, itertools.chain.from_iterable(rows))) <= _STR:
        return False
    return int not in types or all(v.bit_length() <= BIG_INT_BITS for v in values if type(v) is int)


_values = operator.methodcaller("values")


def level(rows: int) -> int:
    """The size class of a segment of *rows* rows: floor(log_FANOUT(rows)) (0 for 0 or 1 row)."""
    return (max(rows, 1).bit_length() - 1) // _FANOUT_BITS


@dataclass
class LogBase:
    """The log as the newest complete checkpoint of this run holds it."""

    #: that checkpoint (None until the write completed).
    path: Path | None
    #: its segments, in reading order.
    segments: list[Segment]
    #: the rows resident in the log at that save whose newest version is in ``segments``, as
    #: saved (plain copies): bounded by the log's window, not by the run's length.
    saved: dict[int, dict[str, Any]]
    #: ``log.evictions`` at that save: rows evicted (or read back) after it may have changed.
    mark: int
    #: ``log.load_count`` at that save (a load replaces the rows: start over).
    loads: int
    #: rows kept in ``state.json`` (or not in any segment): looked at again.
    recheck: list[int] = field(default_factory=list)
    #: resident rows that were empty at that save (not on disk, or ``{}`` there).
    absent: set[int] = field(default_factory=set)
    #: the newest iteration the log held at that save (-1: none).
    newest: int = -1


@dataclass
class LogSave:
    """What one save writes of the log."""

    #: rows kept in ``state.json`` (values that plain JSON cannot hold: nested numpy, huge ints).
    inline: dict[str, Any]
    #: the previous checkpoint's segments to link, in order.
    linked: list[LinkedSegment]
    #: the new segment (None: nothing new or changed), merged with folded ones on disk.
    new: NewSegment | MergedSegment | None
    #: the base after this save; its ``path``/``segments`` are set once the write completed.
    base: LogBase

    def sources(self) -> list[LinkedSegment | NewSegment | MergedSegment]:
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


def _compact(segments: list[Segment]) -> list[Segment]:
    """*segments* with their row lists made compact, in place: a ``range`` when the rows are
    consecutive (the common case), else an array of int64 (8 bytes a row instead of ~36)."""
    for segment in segments:
        rows = segment.rows
        if type(rows) is list:
            ids = sorted(set(rows))
            if ids and ids[-1] - ids[0] + 1 == len(ids):
                segment.rows = range(ids[0], ids[-1] + 1)  # type: ignore[assignment]
            else:
                segment.rows = array("q", ids)  # type: ignore[assignment]
    return segments


def plan(log: TrainingLog, base: LogBase | None, sequence: int) -> LogSave:
    """Decide what save *sequence* writes of *log*, given the newest complete checkpoint's *base*.

    Only the rows that may have changed since *base* are looked at: the rows resident in the
    log (compared with the copies kept from that save), the rows evicted or read back since
    (``log.evicted_since``) and the rows to recheck. Rows evicted before that save and not read
    back since cannot have changed. So a save costs what changed plus the log's window, not the
    history. Nothing is changed: the returned :attr:`LogSave.base` is a new object.

    :raises UnsupportedStateError: for a row value that cannot be saved, naming its key path.
    """
    resident = log.row_map
    mark = log.evictions
    usable = (
        base is not None and base.path is not None and base.loads == log.load_count and base.path.is_dir()
    )
    old: dict[int, dict[str, Any]] = {}
    absent: set[int] = set()
    newest = -1
    if base is None or not usable:
        kept: list[Segment] = []
        current: dict[int, dict[str, Any]] = dict(log.rows())  # every row, evicted ones read back
        current.update(resident)
        write: set[int] = {i for i, row in current.items() if row}
        shadow: set[int] = set()
    else:
        old, kept, absent, newest = base.saved, _compact(list(base.segments)), base.absent, base.newest
        current = dict(resident)
        current.update(log.evicted_since(base.mark))
        current.update(log.peek([i for i in base.recheck if i not in current]))
        # rows with a copy from the last save: compared at C speed (every one is in current)
        write = set(_changed(old, current))
        shadow = set(write)  # on disk: written even when emptied (an empty row hides it)
        for i in current.keys() - old.keys():  # rows created (or read back) since
            if current[i]:
                write.add(i)
            elif i <= newest and i not in absent and any(i in s.rows for s in kept):
                # emptied since and held by a segment this save links or folds: hide it (a row
                # the base kept in its state is on no disk: it is left out, as the log leaves it)
                write.add(i)
                shadow.add(i)
        write.update(base.recheck)
    total = len(write)
    size = level(total)
    folded: list[Segment] = []  # merged on disk into the new segment, before its rows
    while kept:
        tail = 0
        while tail < len(kept) and level(len(kept[-1 - tail].rows)) <= size:
            tail += 1
        if tail < FANOUT - 1:
            break
        folded[:0] = kept[-tail:]
        total += sum(len(segment.rows) for segment in kept[-tail:])
        del kept[-tail:]
        size = level(total)
    missing = [i for i in write if i not in current]
    fresh: Mapping[int, dict[str, Any]] = {}
    if missing:  # folded segments' rows, evicted (current has every resident row): read back
        fresh = log.peek(missing)
        current.update(fresh)
    ids = [i for i in sorted(write) if current.get(i) or i in shadow]
    rows = [current.get(i) or {} for i in ids]
    other: dict[str, Any] = {}  # rows with containers or numpy values: through flatten()
    if _all_plain(rows):  # the common case: every row copied at C speed
        # also the copies kept to compare with (rows read back are copies already)
        flat: dict[str, Any] = dict(zip(map(str, ids), map(dict, rows)))  # in iteration order
    else:
        flat = {}
        for i, row in zip(ids, rows):
            if _is_plain(row):
                flat[str(i)] = row if i in fresh else dict(row)
            else:
                flat[str(i)] = plain = plain_row(row)  # numpy values made Python ones
                if not _is_plain(plain):
                    other[str(i)] = plain
    inline: dict[str, Any] = {}
    recheck: list[int] = []
    if other:
        snapshot = flatten({"log": {"rows": other}})
        flat.update(snapshot.tree["log"]["rows"])  # rebuilt containers: copies the log cannot change
        for entry in (*snapshot.index, *snapshot.ints):
            key = entry["path"][2]
            if key not in inline:  # not plain JSON: kept in state.json (read after the segments)
                inline[key] = other[key]
                del flat[key]
                recheck.append(int(key))
    if not folded and flat and sum(map(len, flat.values())) + len(flat) <= INLINE_VALUES:
        # few: in the state (in iteration order, as the log holds them), looked at again by
        # the next save (recheck)
        both = {**inline, **flat}
        inline = {key: both[key] for key in sorted(both, key=int)}
        recheck.extend(map(int, flat))
        flat = {}
    # the copies to compare with next time: resident rows only (evicted ones cannot change)
    saved: dict[int, dict[str, Any]] = {}
    new_absent: set[int] = set()
    for i, row in resident.items():
        if not row:
            new_absent.add(i)
            continue
        written = flat.get(str(i))
        if written is not None:
            saved[i] = written
        elif i not in write and i in old:
            saved[i] = old[i]
    for key in inline:
        saved.pop(int(key), None)
    newest = max(newest, max(current, default=-1))
    source = base.path if base is not None else None
    new: NewSegment | MergedSegment | None = None
    if folded and source is not None:
        merged = itertools.chain(map(int, flat), *(segment.rows for segment in folded))
        parts = [LinkedSegment(source, segment) for segment in folded]
        new = MergedSegment(segment_name(sequence, merged), parts, flat, _reloader(log))
    elif flat:
        new = NewSegment(segment_name(sequence, map(int, flat)), flat)
    linked = [LinkedSegment(source, s) for s in kept] if source is not None else []
    return LogSave(
        inline, linked, new, LogBase(None, [], saved, mark, log.load_count, recheck, new_absent, newest)
    )


def _reloader(log: TrainingLog) -> Any:
    """The rows of a segment from the log, for a merge whose segment file fails verification
    (its rows as the log holds them now: newer, never older, than the file's)."""

    def reload(segment: Segment) -> dict[str, Any]:
        rows = log.peek(list(segment.rows))  # a row emptied since is written as {}: it hides older ones
        plain = {str(i): plain_row(rows[i]) if rows.get(i) else {} for i in segment.rows}
        return dict(flatten(plain).tree)

    return reload


def resumed_base(
    log: TrainingLog, info: CheckpointInfo, rows: Mapping[str, dict[str, Any]]
) -> LogBase | None:
    """The base of a run resumed from checkpoint *info*, whose state's log rows were *rows*.

    Called after the loop loaded that state (``log.load_count`` counts it); the rows of the state
    are the ones the loop copied into the log (the oldest of them may be evicted already).
    """
    if info.segments is None or log.load_count == 0:
        return None
    inline = set(info.inline_rows)
    on_disk: set[int] = set().union(*(s.rows for s in info.segments))
    recheck = sorted(inline | {int(i) for i in rows if int(i) not in on_disk})
    saved = {}
    for i, row in log.row_map.items():
        if i in inline or i not in on_disk or not row:
            continue
        mutable = any(type(v) in _MUTABLE for v in row.values())
        saved[i] = copy.deepcopy(row) if mutable else dict(row)
    absent = {i for i, row in log.row_map.items() if not row}
    newest = max((int(i) for i in rows), default=-1)
    segments = _compact(list(info.segments))
    return LogBase(info.path, segments, saved, log.evictions, log.load_count, recheck, absent, newest)
