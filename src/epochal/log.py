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

import contextlib
import copy
import heapq
import marshal
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import sqlite3

#: rows kept in memory at least; the log evicts when twice as many are resident.
DEFAULT_WINDOW = 1024
#: row values that a row may hold and still be evicted (they round-trip exactly, cannot change).
_SCALARS = frozenset({float, int, str, bool, type(None), bytes})
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
        self.window = window or None
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
            row = self._spill.reload(iteration) if self._spill is not None else None
            if row is None:
                row = {}
            else:
                self._reloaded.add(iteration)
                self._spilled_last_stale = True
            self._add(iteration, row)
        return row

    def _add(self, iteration: int, row: dict[str, Any]) -> None:
        self._rows[iteration] = row
        if iteration > self._newest:
            self._newest = iteration
            # evict only when the log advances: a row just returned by log[i] stays resident
            if self.window is not None and len(self._rows) > 2 * self.window:
                self._evict()
        else:
            self._ordered = False

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
        row = self._rows.get(self._iteration())
        return row if row is not None else self[self._iteration()]

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
        order = list(self._rows)  # creation (or read-back) order
        out: list[tuple[int, dict[str, Any]]] = []
        for i in order[: len(order) - self.window]:
            row = self._rows[i]
            if i == current or not _evictable(row):
                continue
            out.append((i, _plain_scalars(row)))
        if not out:
            self.window *= 2  # pinned rows fill the window: let it grow rather than rescan each row
            return
        if self._spill is None:
            self._spill = _Spill()
        reloaded = self._reloaded
        self._spill.put(out, replacing=[i for i, _ in out if i in reloaded])
        last = self._spilled_last
        for i, row in out:
            del self._rows[i]
            reloaded.discard(i)
            for key, value in row.items():
                seen = last.get(key)
                if seen is None or seen[0] <= i:
                    last[key] = (i, value)
        if not self._ordered:
            keys = list(self._rows)
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


def _first(item: tuple[int, Any]) -> int:
    return item[0]


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
    """Evicted rows in a private temporary SQLite database: ``(iteration, sequence, marshal(row))``."""

    def __init__(self) -> None:
        import sqlite3  # here: `import epochal` (and every CLI start) does not pay for it

        # "": a private temporary database, on disk beyond its page cache, deleted on close
        self.db: sqlite3.Connection = sqlite3.connect("", isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=OFF")
        self.db.execute("PRAGMA cache_size=-512")  # KiB: the page cache is most of its memory
        self.db.execute("CREATE TABLE rows (iteration INTEGER PRIMARY KEY, seq INTEGER NOT NULL, data BLOB)")
        self.db.execute("CREATE INDEX rows_seq ON rows (seq)")
        self.count = 0
        self.sequence = 0
        #: the newest iteration ever spilled: a newer row is not in the file (no query per new row).
        self.newest = -1

    def put(self, rows: list[tuple[int, dict[str, Any]]], replacing: list[int]) -> None:
        self.sequence += 1
        seq = self.sequence
        dumps = marshal.dumps
        self.db.execute("BEGIN")
        self.db.executemany(
            "INSERT OR REPLACE INTO rows VALUES (?, ?, ?)", [(i, seq, dumps(row)) for i, row in rows]
        )
        self.db.execute("COMMIT")
        self.count += len(rows) - len(replacing)
        self.newest = max(self.newest, max(i for i, _ in rows))

    def reload(self, iteration: int) -> dict[str, Any] | None:
        if iteration > self.newest:
            return None
        found = self.db.execute("SELECT data FROM rows WHERE iteration = ?", (iteration,)).fetchone()
        if found is None:
            return None
        self.sequence += 1
        self.db.execute("UPDATE rows SET seq = ? WHERE iteration = ?", (self.sequence, iteration))
        row: dict[str, Any] = marshal.loads(found[0])
        return row

    def has(self, iteration: int) -> bool:
        if iteration > self.newest:
            return False
        return self.db.execute("SELECT 1 FROM rows WHERE iteration = ?", (iteration,)).fetchone() is not None

    def get_many(self, iterations: list[int]) -> dict[int, dict[str, Any]]:
        found: dict[int, dict[str, Any]] = {}
        loads = marshal.loads
        for start in range(0, len(iterations), 500):
            chunk = iterations[start : start + 500]
            query = f"SELECT iteration, data FROM rows WHERE iteration IN ({','.join('?' * len(chunk))})"
            found.update((i, loads(data)) for i, data in self.db.execute(query, chunk))
        return found

    def scan(self) -> Iterator[tuple[int, dict[str, Any]]]:
        loads = marshal.loads
        for i, data in self.db.execute("SELECT iteration, data FROM rows ORDER BY iteration"):
            yield i, loads(data)

    def since(self, mark: int) -> Iterator[tuple[int, dict[str, Any]]]:
        loads = marshal.loads
        # no ORDER BY: with it SQLite scans the whole table in iteration order instead of
        # searching the seq index (a cost growing with the run); the few rows are sorted here
        query = "SELECT iteration, data FROM rows WHERE seq > ?"
        for i, data in sorted(self.db.execute(query, (mark,))):
            yield i, loads(data)

    def last_values(self, exclude: set[int]) -> dict[str, tuple[int, Any]]:
        last: dict[str, tuple[int, Any]] = {}
        for i, row in self.scan():
            if i not in exclude:
                for key, value in row.items():
                    last[key] = (i, value)
        return last

    def close(self) -> None:
        self.db.close()


def plain_row(row: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of *row*, numpy scalars and arrays made Python values (as :meth:`TrainingLog.state_dict`)."""
    return {k: _plain(v) for k, v in row.items()}


def _plain(value: Any) -> Any:
    """Turn numpy scalars and arrays into Python values so they serialise as JSON."""
    tolist = getattr(value, "tolist", None)
    return tolist() if tolist is not None else value
