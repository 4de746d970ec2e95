"""The training log: rows of records keyed by iteration, plus the run's status.

Blocks' ``TrainingLog`` semantics: ``log[i]`` is the row (a dict) of iteration ``i``, created
empty on first access; ``log.current_row`` is the row of the loop's current iteration;
``log.status`` holds what describes the run rather than an iteration. Plugins write records
(``loop.log.current_row["valid.loss"] = 0.3``) and read them back (``log.last("valid.loss")``).

Memory is bounded by a window, not by the length of the run: only the newest rows stay in memory
(*resident*); older rows whose values are plain scalars are moved (*evicted*) to a spill file, a
private temporary SQLite database, and read back lazily by every reading method. A row read
through ``log[i]`` becomes resident again (it may be written to). See docs/concepts.md for what
a plugin may rely on.
"""

from __future__ import annotations

import bisect
import contextlib
import copy
import heapq
import marshal
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from itertools import chain
from operator import itemgetter
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import sqlite3

#: rows kept in memory at least; the log evicts when twice as many are resident.
DEFAULT_WINDOW = 1024
#: row values that a row may hold and still be evicted (they round-trip exactly, cannot change).
_SCALARS = frozenset({float, int, str, bool, type(None), bytes})
_STRINGS = frozenset({str})
_MISSING = object()


class TrainingLog:
    """Rows of ``{key: value}`` keyed by iteration, and a ``status`` dict.

    :param iteration: returns the loop's current iteration (the row of :attr:`current_row`).
    :param window: rows kept in memory at least (default: ``$EPOCHAL_LOG_WINDOW`` or
        :data:`DEFAULT_WINDOW`; 0 or None: never evict).
    """

    def __init__(self, iteration: Callable[[], int] = lambda: 0, window: int | None = None) -> None:
        self._rows: dict[int, dict[str, Any]] = {}
        self._iteration = iteration
        if window is None:
            window = int(os.environ.get("EPOCHAL_LOG_WINDOW", DEFAULT_WINDOW))
        self.window = window
        self._spill: _Spill | None = None
        #: iterations resident now that were read back from the spill (they are in it too).
        self._reloaded: set[int] = set()
        #: the newest spilled value of each key: key -> (iteration, value); rebuilt when stale.
        self._spilled_last: dict[str, tuple[int, Any]] = {}
        self._spilled_last_stale = False
        #: resident iterations were created in increasing order (``reversed`` is newest first).
        self._ordered = True
        self._newest = -1
        self.status: dict[str, Any] = {
            "status": "created",
            "epochs_done": 0,
            "iterations_done": 0,
            "finish_reason": None,
            "resumed_from": None,
        }
        #: how many times :meth:`load_state_dict` replaced every row.
        self.load_count = 0

    # -- rows -------------------------------------------------------------------------------------

    def __getitem__(self, iteration: int) -> dict[str, Any]:
        row = self._rows.get(iteration)
        if row is None:
            if iteration < 0:
                raise IndexError(f"iteration {iteration} is negative")
            spill = self._spill
            if spill is not None and iteration <= spill.newest:
                row = spill.reload(iteration)
            if row is None:
                row = {}
            else:
                self._reloaded.add(iteration)
                self._spilled_last_stale = True
            self._add(iteration, row)
        return row

    def _add(self, iteration: int, row: dict[str, Any]) -> None:
        rows = self._rows
        rows[iteration] = row
        if iteration > self._newest:
            self._newest = iteration
            # evict only when the log advances: a row just returned by log[i] stays resident
            if len(rows) > self._evict_above:
                self._evict()
        else:
            self._ordered = False

    @property
    def window(self) -> int | None:
        """Rows kept in memory at least (None: every row)."""
        return self._window

    @window.setter
    def window(self, window: int | None) -> None:
        self._window = window or None
        #: evict when more rows than this are resident (twice the window).
        self._evict_above = 2 * window if window else sys.maxsize

    def __contains__(self, iteration: object) -> bool:
        if iteration in self._rows:
            return True
        return self._spill is not None and isinstance(iteration, int) and self._spill.has(iteration)

    def __len__(self) -> int:
        spilled = self._spill.count if self._spill is not None else 0
        return len(self._rows) + spilled - len(self._reloaded)

    @property
    def current_row(self) -> dict[str, Any]:
        """The row of the loop's current iteration (batches completed so far)."""
        iteration = self._iteration()
        rows = self._rows
        row = rows.get(iteration)
        if row is not None:
            return row
        if iteration <= self._newest:  # not the newest: maybe evicted, read back by log[i]
            return self[iteration]
        # the log advances (once per iteration with a record): self[iteration] without its calls
        row = rows[iteration] = {}
        self._newest = iteration
        if len(rows) > self._evict_above:
            self._evict()
        return row

    @property
    def previous_row(self) -> dict[str, Any]:
        """The row of the iteration before the current one."""
        return self[self._iteration() - 1]

    def rows(self) -> Iterator[tuple[int, dict[str, Any]]]:
        """Yield ``(iteration, row)`` for every non-empty row, in iteration order.

        Rows read back from the spill are fresh copies: change a row through ``log[i]``.
        """
        resident = sorted(self._rows.items())
        if self._spill is None:
            yield from ((i, row) for i, row in resident if row)
            return
        reloaded = self._reloaded
        spilled = ((i, row) for i, row in self._spill.scan() if i not in reloaded)
        for i, row in heapq.merge(spilled, resident, key=_first):
            if row:
                yield i, row

    @property
    def row_map(self) -> Mapping[int, dict[str, Any]]:
        """The resident rows by iteration, empty ones included, as a read-only view (no copy, O(1)).

        The row dicts are the live rows: read them, don't change them through this view. Rows
        outside the view are evicted and cannot change until ``log[i]`` makes them resident
        again; :meth:`evicted_since` lists them for savers that write what changed.
        """
        return MappingProxyType(self._rows)

    def peek(self, iterations: Iterable[int]) -> dict[int, dict[str, Any]]:
        """The rows of *iterations* that exist (resident or evicted), without making them resident.

        Evicted rows come back as fresh copies.
        """
        rows = self._rows
        if type(iterations) is range and iterations.step == 1 and len(iterations) > len(rows):
            # a span longer than the resident rows (sparse rows: records once per epoch): the
            # resident rows in it, and the spilled ones, without a lookup per iteration
            lo, hi = iterations.start, iterations.stop
            spilled = self._spill.span(lo, hi) if self._spill is not None else {}
            spilled.update((i, row) for i, row in rows.items() if lo <= i < hi)
            return spilled
        found: dict[int, dict[str, Any]] = {}
        missing = []
        for i in iterations:
            row = self._rows.get(i)
            if row is not None:
                found[i] = row
            else:
                missing.append(i)
        if missing and self._spill is not None:
            found.update(self._spill.get_many(missing))
        return found

    @property
    def evictions(self) -> int:
        """A counter of evictions and read-backs: a mark for :meth:`evicted_since`."""
        return self._spill.sequence if self._spill is not None else 0

    def evicted_since(self, mark: int) -> dict[int, dict[str, Any]]:
        """The rows evicted (or read back) after *mark* (an earlier :attr:`evictions`) and still evicted.

        With the resident rows, they are every row that may have changed since the mark.
        """
        if self._spill is None:
            return {}
        return {i: row for i, row in self._spill.since(mark) if i not in self._rows}

    def _evict(self) -> None:
        """Move the resident rows beyond the window (oldest created or read back first) to the spill."""
        assert self.window is not None
        current = self._iteration()
        rows = self._rows
        order = list(rows)  # creation (or read-back) order
        out = [(i, rows[i]) for i in order[: len(order) - self.window] if i != current]
        if not self._ordered:
            out.sort(key=_first)
        # The common case checked at C speed: every key a string, every value a Python scalar.
        values = chain.from_iterable(map(dict.values, map(_second, out)))
        names = chain.from_iterable(map(_second, out))
        if not (_SCALARS.issuperset(map(type, values)) and _STRINGS.issuperset(map(type, names))):
            out = [(i, _plain_scalars(row)) for i, row in out if _evictable(row)]
        if not out:
            self.window *= 2  # pinned rows fill the window: let it grow rather than rescan each row
            return
        if self._spill is None:
            self._spill = _Spill()
        reloaded = self._reloaded
        before = self._spill.newest
        self._spill.put(out, replacing=[i for i, _ in out if i in reloaded] if reloaded else [])
        for i, _ in out:
            del rows[i]
        last = self._spilled_last
        # rows newer than any spilled before: the newest value of each key, from the newest row
        seen: set[str] = set()
        for i, row in reversed(out):
            if i <= before:
                break
            if not seen.issuperset(row):
                for key, value in row.items():
                    if key not in seen:
                        seen.add(key)
                        last[key] = (i, value)
        for i, row in out:  # rows spilled again after a read-back, or older than the spill
            if i > before:
                break
            reloaded.discard(i)
            for key, value in row.items():
                found = last.get(key)
                if found is None or found[0] <= i:
                    last[key] = (i, value)
        if not self._ordered:
            keys = list(rows)
            self._ordered = keys == sorted(keys)

    def last(self, key: str, default: Any = None) -> Any:
        """The most recent value recorded under *key*, or *default*."""
        rows = self._rows
        for iteration in reversed(rows) if self._ordered else sorted(rows, reverse=True):
            row = rows[iteration]
            if key in row:
                newest: tuple[int, Any] = (iteration, row[key])
                break
        else:
            newest = (-1, _MISSING)
        if self._spill is not None:
            if self._spilled_last_stale:
                self._spilled_last = self._spill.last_values(exclude=self._reloaded)
                self._spilled_last_stale = False
            spilled = self._spilled_last.get(key)
            if spilled is not None and spilled[0] > newest[0] and spilled[0] not in rows:
                newest = spilled
        return default if newest[1] is _MISSING else newest[1]

    def history(self, key: str) -> list[tuple[int, Any]]:
        """Every ``(iteration, value)`` recorded under *key*, in order."""
        return [(i, row[key]) for i, row in self.rows() if key in row]

    def state_dict(self, rows: bool = True) -> dict[str, Any]:
        """The log as JSON-able data (numpy scalars become Python numbers).

        With ``rows=False`` the ``"rows"`` mapping is left empty: for a saver that writes the
        rows itself, incrementally (see :attr:`row_map` and :meth:`evicted_since`).
        """
        saved = {str(i): plain_row(row) for i, row in self.rows()} if rows else {}
        return {"rows": saved, "status": plain_row(self.status)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replace the log's contents with *state* from :meth:`state_dict`."""
        if self._spill is not None:
            self._spill.close()
        self._spill, self._reloaded, self._spilled_last = None, set(), {}
        self._spilled_last_stale, self._rows, self._ordered, self._newest = False, {}, True, -1
        for i, row in state["rows"].items():
            self._add(int(i), dict(row))
        self.status = copy.deepcopy(dict(state["status"]))
        self.load_count += 1

    def close(self) -> None:
        """Remove the spill file (the evicted rows are lost; resident ones stay)."""
        if self._spill is not None:
            self._spill.close()
            self._spill = None

    def __del__(self) -> None:
        spill = getattr(self, "_spill", None)
        if spill is not None:
            with contextlib.suppress(Exception):  # at interpreter exit sqlite3 may be gone already
                spill.close()


_first = itemgetter(0)
_second = itemgetter(1)


def _evictable(row: Mapping[str, Any]) -> bool:
    for key, value in row.items():
        if type(key) is not str:
            return False
        if type(value) not in _SCALARS and not (
            getattr(value, "ndim", None) == 0 and hasattr(value, "item") and type(value.item()) in _SCALARS
        ):
            return False
    return True


def _plain_scalars(row: dict[str, Any]) -> dict[str, Any]:
    """*row* itself when it holds only Python scalars, else a copy with numpy scalars made Python's."""
    if set(map(type, row.values())) <= _SCALARS:
        return row
    return {k: v if type(v) in _SCALARS else v.item() for k, v in row.items()}


class _Spill:
    """Evicted rows in a private temporary SQLite database.

    The log advancing evicts rows newer than any spilled before: each eviction stores them as
    one *chunk*, one database row ``chunks(seq, first, last, data)`` holding the marshalled
    ``{iteration: row}`` of those rows (iterations ``first`` to ``last``, with gaps where rows
    stayed resident). Chunks never overlap, so a row is found by a bisection over the chunks'
    first iterations, kept in memory (a few bytes per chunk, not per row). Rows evicted again
    after being read back, or older than rows spilled already, are stored one per database row
    in ``rows(iteration, seq, data)``, whose copy wins over a chunk's. One insert per eviction
    rather than one per row: SQLite's per-row cost (~1.3 µs) was most of the cost of a record
    written every step.
    """

    def __init__(self) -> None:
        import sqlite3  # here: `import epochal` (and every CLI start) does not pay for it

        # "": a private temporary database, on disk beyond its page cache, deleted on close
        self.db: sqlite3.Connection = sqlite3.connect("", isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=OFF")
        self.db.execute("PRAGMA cache_size=-512")  # KiB: the page cache is most of its memory
        self.db.execute(
            "CREATE TABLE chunks (seq INTEGER PRIMARY KEY, first INTEGER NOT NULL, last INTEGER NOT NULL, "
            "data BLOB NOT NULL)"
        )
        self.db.execute("CREATE TABLE rows (iteration INTEGER PRIMARY KEY, seq INTEGER NOT NULL, data BLOB)")
        self.db.execute("CREATE INDEX rows_seq ON rows (seq)")
        self.count = 0
        self.sequence = 0
        #: the newest iteration ever spilled: a newer row is not in the file (no query per new row).
        self.newest = -1
        #: the chunks' first iterations, and (first, last, seq) of each, in iteration (= seq) order.
        self._firsts: list[int] = []
        self._chunks: list[tuple[int, int, int]] = []
        #: whether the ``rows`` table holds anything (else it is not queried).
        self._singles = False
        #: the last chunk read: (seq, {iteration: row}); its rows are handed out as copies.
        self._cached: tuple[int, dict[int, dict[str, Any]]] = (-1, {})

    def put(self, rows: list[tuple[int, dict[str, Any]]], replacing: list[int]) -> None:
        """Store *rows* (the log's evicted rows, in iteration order); *replacing*: those already in
        the file."""
        self.sequence += 1
        seq = self.sequence
        newest = self.newest
        if rows[0][0] > newest:  # in iteration order: every row is newer than the spill (the rule)
            fresh, late = rows, []
        else:
            fresh = [item for item in rows if item[0] > newest]
            late = [item for item in rows if item[0] <= newest]
        db = self.db
        db.execute("BEGIN")
        if fresh:
            first, last = fresh[0][0], fresh[-1][0]
            db.execute(
                "INSERT INTO chunks VALUES (?, ?, ?, ?)", (seq, first, last, marshal.dumps(dict(fresh)))
            )
            self._firsts.append(first)
            self._chunks.append((first, last, seq))
            self.newest = last
        if late:
            dumps = marshal.dumps
            db.executemany(
                "INSERT OR REPLACE INTO rows VALUES (?, ?, ?)", [(i, seq, dumps(row)) for i, row in late]
            )
            self._singles = True
        db.execute("COMMIT")
        self.count += len(rows) - len(replacing)

    def _chunk(self, iteration: int) -> dict[int, dict[str, Any]] | None:
        """The rows of the chunk whose range holds *iteration* (shared: copy a row handed out)."""
        k = bisect.bisect_right(self._firsts, iteration) - 1
        if k < 0:
            return None
        _, last, seq = self._chunks[k]
        if iteration > last:
            return None
        if self._cached[0] != seq:
            self._cached = (seq, self._read_chunk(seq))
        return self._cached[1]

    def _read_chunk(self, seq: int) -> dict[int, dict[str, Any]]:
        (data,) = self.db.execute("SELECT data FROM chunks WHERE seq = ?", (seq,)).fetchone()
        rows: dict[int, dict[str, Any]] = marshal.loads(data)
        return rows

    def _single(self, iteration: int) -> bytes | None:
        if not self._singles:
            return None
        found = self.db.execute("SELECT data FROM rows WHERE iteration = ?", (iteration,)).fetchone()
        return None if found is None else found[0]

    def reload(self, iteration: int) -> dict[str, Any] | None:
        """A copy of the row of *iteration* (None if not spilled), which is being read back."""
        if iteration > self.newest:
            return None
        data = self._single(iteration)
        if data is not None:
            self.sequence += 1
            self.db.execute("UPDATE rows SET seq = ? WHERE iteration = ?", (self.sequence, iteration))
            row: dict[str, Any] = marshal.loads(data)
            return row
        chunk = self._chunk(iteration)
        found = None if chunk is None else chunk.get(iteration)
        if found is None:
            return None
        self.sequence += 1  # a read-back: it may change now (resident, or evicted again later)
        return dict(found)  # rows hold scalars only: a shallow copy is a copy

    def has(self, iteration: int) -> bool:
        if iteration > self.newest:
            return False
        if self._single(iteration) is not None:
            return True
        chunk = self._chunk(iteration)
        return chunk is not None and iteration in chunk

    def get_many(self, iterations: list[int]) -> dict[int, dict[str, Any]]:
        found: dict[int, dict[str, Any]] = {}
        loads = marshal.loads
        if self._singles:
            for start in range(0, len(iterations), 500):
                part = iterations[start : start + 500]
                query = f"SELECT iteration, data FROM rows WHERE iteration IN ({','.join('?' * len(part))})"
                found.update((i, loads(data)) for i, data in self.db.execute(query, part))
        wanted = sorted(i for i in iterations if i not in found and 0 <= i <= self.newest)
        if not wanted:
            return found
        firsts = self._firsts
        start = max(0, bisect.bisect_right(firsts, wanted[0]) - 1)
        for first, last, seq in self._chunks[start : bisect.bisect_right(firsts, wanted[-1])]:
            lo, hi = bisect.bisect_left(wanted, first), bisect.bisect_right(wanted, last)
            if lo < hi:  # each chunk read once, its rows fresh (not the cached copy)
                get = self._read_chunk(seq).get
                for i in wanted[lo:hi]:
                    row = get(i)
                    if row is not None:
                        found[i] = row
        return found

    def span(self, lo: int, hi: int) -> dict[int, dict[str, Any]]:
        """The spilled rows of iterations ``lo <= i < hi`` (their newest copies, fresh)."""
        found: dict[int, dict[str, Any]] = {}
        if lo > self.newest or hi <= lo:
            return found
        firsts = self._firsts
        start = max(0, bisect.bisect_right(firsts, lo) - 1)
        for first, last, seq in self._chunks[start : bisect.bisect_left(firsts, hi)]:
            if last < lo:
                continue
            chunk = self._read_chunk(seq)
            if lo <= first and last < hi:
                found.update(chunk)
            else:
                found.update((i, row) for i, row in chunk.items() if lo <= i < hi)
        if self._singles:  # newer than a chunk's copy
            loads = marshal.loads
            query = "SELECT iteration, data FROM rows WHERE iteration >= ? AND iteration < ?"
            found.update((i, loads(data)) for i, data in self.db.execute(query, (lo, hi)))
        return found

    def scan(self) -> Iterator[tuple[int, dict[str, Any]]]:
        """Every spilled row (its newest copy), fresh copies, in iteration order."""
        loads = marshal.loads
        singles: Iterator[tuple[int, bytes]] = iter(())
        if self._singles:
            singles = iter(self.db.execute("SELECT iteration, data FROM rows ORDER BY iteration").fetchall())
        single = next(singles, None)
        for _, _, seq in list(self._chunks):
            for i, row in self._read_chunk(seq).items():  # in iteration order (see put)
                while single is not None and single[0] < i:
                    yield single[0], loads(single[1])
                    single = next(singles, None)
                if single is not None and single[0] == i:
                    yield i, loads(single[1])
                    single = next(singles, None)
                else:
                    yield i, row
        while single is not None:
            yield single[0], loads(single[1])
            single = next(singles, None)

    def since(self, mark: int) -> Iterator[tuple[int, dict[str, Any]]]:
        """The rows (newest copies) stored after *mark*, an earlier :attr:`sequence`, in order."""
        found: dict[int, dict[str, Any]] = {}
        for _, _, seq in reversed(self._chunks):
            if seq <= mark:
                break
            for i, row in self._read_chunk(seq).items():
                found.setdefault(i, row)  # a newer chunk's copy was taken first
        if self._singles:  # a single row is always newer than a chunk's copy of it
            loads = marshal.loads
            for i, data in self.db.execute("SELECT iteration, data FROM rows WHERE seq > ?", (mark,)):
                found[i] = loads(data)
        for i in sorted(found):
            yield i, found[i]

    def last_values(self, exclude: set[int]) -> dict[str, tuple[int, Any]]:
        last: dict[str, tuple[int, Any]] = {}
        for i, row in self.scan():
            if i not in exclude:
                for key, value in row.items():
                    last[key] = (i, value)
        return last

    def close(self) -> None:
        self._cached = (-1, {})
        self.db.close()


def plain_row(row: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of *row*, numpy scalars and arrays made Python values (as :meth:`TrainingLog.state_dict`)."""
    return {k: _plain(v) for k, v in row.items()}


def _plain(value: Any) -> Any:
    """Turn numpy scalars and arrays into Python values so they serialise as JSON."""
    tolist = getattr(value, "tolist", None)
    return tolist() if tolist is not None else value
