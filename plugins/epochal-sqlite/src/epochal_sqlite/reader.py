"""Reading a database: runs, records, a resume chain's timeline (the CLI's and notebooks' side).

:class:`Reader` opens the file read-only (see :func:`epochal_sqlite.store.connect_readonly`);
runs whose writer is gone are shown as killed, and marked so in the file when the reader
closes, where the file is writable.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import sqlite3
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from epochal_sqlite.liveness import dead_runs, killed_reason, mark_killed
from epochal_sqlite.store import (
    UnknownRunError,
    _quote,
    _writable,
    connect_readonly,
    decode,
    failures,
)


@dataclass
class Run:
    """One row of the ``runs`` table."""

    run_id: str
    started: float
    ended: float | None
    updated: float | None
    status: str
    finish_reason: str | None
    error: str | None
    error_plugin: str | None
    epochs_done: int
    iterations_done: int
    start_iteration: int
    flushed_iteration: int
    resumed_from: str | None
    config: Any
    plugins: Any
    log_status: Any
    run_dir: str | None
    host: str | None
    pid: int | None
    epochal_version: str | None

    def as_dict(self) -> dict[str, Any]:
        """The run as a JSON-able dict."""
        return dict(vars(self))


_RUN_COLUMNS = (
    "run_id, started, ended, updated, status, finish_reason, error, error_plugin, epochs_done, "
    "iterations_done, start_iteration, flushed_iteration, resumed_from, config, plugins, log_status, "
    "run_dir, host, pid, epochal_version"
)


def _run(row: Sequence[Any]) -> Run:
    values = list(row)
    for index in (13, 14, 15):  # config, plugins, log_status
        values[index] = json.loads(values[index]) if values[index] else None
    return Run(*values)


class Reader:
    """Read access to a database for the CLI and notebooks (marks killed runs when opened).

    >>> with Reader("runs/digits/epochal.sqlite") as db:  # doctest: +SKIP
    ...     run = db.resolve("latest")
    ...     rows = db.timeline(run.run_id)
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        wal = self.path.with_name(self.path.name + "-wal")
        #: the -wal and -shm files a read-only connection leaves are ours to tidy away
        self._tidy = not wal.exists()
        self.conn = connect_readonly(self.path)
        try:
            with failures(self.path, "cannot read the training log", "it was left as it is"):
                #: runs shown as killed; marked so in the file when it is closed, if writable
                self._killed = set(dead_runs(self.conn, self.path))
        except BaseException:
            self.conn.close()
            raise
        self._found = time.time()

    def close(self, tidy: bool = True) -> None:
        """Close the connection. With *tidy*, where the file is writable, a short write
        connection marks the killed runs found in it and removes the ``-wal``/``-shm`` files
        the reading left (a read-only connection cannot), unless another connection uses them."""
        self.conn.close()
        if not tidy or not (self._killed or self._tidy):
            return
        if not (_writable(self.path) and _writable(self.path.parent)):
            return
        with contextlib.suppress(sqlite3.Error, OSError):
            uri = f"file:{_quote(self.path)}?mode=rw"
            conn = sqlite3.connect(uri, uri=True, timeout=1.0, isolation_level=None)
            try:
                if self._killed:
                    mark_killed(conn, self.path)
                else:
                    # a read opens the WAL: the last connection to close removes it
                    conn.execute("PRAGMA user_version").fetchone()
            finally:
                conn.close()

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, kind: object, error: object, traceback: object) -> None:
        self.close(tidy=error is None)  # after an error (a damaged page): no write at all

    def _run(self, row: Sequence[Any]) -> Run:
        run = _run(row)
        if run.status == "running" and run.run_id in self._killed:  # as mark_killed would mark it
            run.status, run.ended = "killed", run.updated or run.started
            run.finish_reason = killed_reason(self._found)
        return run

    def runs(self) -> list[Run]:
        """Every run, oldest first."""
        query = f"SELECT {_RUN_COLUMNS} FROM runs ORDER BY started, run_id"
        return [self._run(row) for row in self.conn.execute(query)]

    def get(self, run_id: str) -> Run | None:
        """The run with exactly this id, or None."""
        row = self.conn.execute(f"SELECT {_RUN_COLUMNS} FROM runs WHERE run_id = ?", (run_id,)).fetchone()
        return self._run(row) if row else None

    def resolve(self, ref: str) -> Run:
        """The run named by *ref*: a full run id, a unique prefix of one, or ``latest``.

        :raises UnknownRunError: no run or several runs match.
        """
        if ref == "latest":
            row = self.conn.execute(
                f"SELECT {_RUN_COLUMNS} FROM runs ORDER BY started DESC, run_id DESC LIMIT 1"
            ).fetchone()
            if row is None:
                raise UnknownRunError(f"{self.path} holds no runs yet")
            return self._run(row)
        exact = self.get(ref)
        if exact is not None:
            return exact
        # A prefix match with bound parameters: range of ids between ref and ref + U+FFFF.
        rows = self.conn.execute(
            f"SELECT {_RUN_COLUMNS} FROM runs WHERE run_id >= ? AND run_id < ? ORDER BY started",
            (ref, ref + "\uffff"),
        ).fetchall()
        if len(rows) == 1 and ref:
            return self._run(rows[0])
        count = self.conn.execute("SELECT count(*) FROM runs").fetchone()[0]
        if not rows or not ref:
            raise UnknownRunError(
                f"no run {ref!r} in {self.path} ({count} run(s); `epochal log runs --db {self.path}` "
                "lists them)"
            )
        ids = ", ".join(r[0][:12] for r in rows[:5]) + (", ..." if len(rows) > 5 else "")
        raise UnknownRunError(
            f"run prefix {ref!r} is ambiguous in {self.path}: {len(rows)} runs match ({ids})"
        )

    def chain(self, run: Run) -> list[Run]:
        """The resume chain ending in *run*, oldest first (ancestors not in this file are left out)."""
        chain = [run]
        seen = {run.run_id}
        while chain[0].resumed_from and chain[0].resumed_from not in seen:
            parent = self.get(chain[0].resumed_from)
            if parent is None:
                break
            seen.add(parent.run_id)
            chain.insert(0, parent)
        return chain

    def records(
        self, run_id: str, upto: int | None = None, keys: Sequence[str] = (), superseded: bool = False
    ) -> Iterator[tuple[int, str, Any]]:
        """``(iteration, key, value)`` of one run in iteration order, up to iteration *upto*.

        Records superseded (written after the point a later run resumed from) are left out
        unless *superseded* is true.
        """
        names = self._key_names()
        wanted = self._wanted(keys, names)
        if len(wanted) == 1:
            name = names[wanted[0]]
            for iteration, value in self._run_series(run_id, wanted[0], upto, superseded):
                yield iteration, name, value
            return
        found = [
            (iteration, names[key], value)
            for key in wanted
            for iteration, value in self._run_series(run_id, key, upto, superseded)
        ]
        found.sort(key=_by_iteration_and_key)  # in iteration order, then by key name (as version 1)
        yield from found

    def _wanted(self, keys: Sequence[str], names: dict[int, str] | None = None) -> list[int]:
        """The ids of the keys matching the glob patterns *keys* (no patterns: every key)."""
        match = key_matcher(keys)
        return [i for i, name in (names or self._key_names()).items() if match(name)]

    def _run_series(self, run_id: str, key: int, upto: int | None, superseded: bool) -> list[tuple[int, Any]]:
        """``(iteration, value)`` of one key of the run *run_id*, up to *upto*."""
        row = self.conn.execute(
            "SELECT num, superseded_after FROM runs WHERE run_id = ?", (run_id,)
        ).fetchone()
        if row is None:
            return []
        run, after = row
        stop = upto  # records past *stop* are not wanted (beyond upto, or superseded)
        if not superseded and after is not None:
            stop = after if stop is None else min(stop, after)
        return self._series(run, key, stop, superseded)

    def _series(self, run: int, key: int, stop: int | None, superseded: bool) -> list[tuple[int, Any]]:
        """``(iteration, value)`` of one key of one run, in iteration order, up to *stop*."""
        query = "SELECT first, last, steps, vals, kind FROM chunks WHERE run = ? AND key = ?"
        params: tuple[int, ...] = (run, key)
        if not superseded:
            query += " AND superseded = 0"
        if stop is not None:
            query += " AND first <= ?"
            params += (stop,)
        pieces: list[list[tuple[int, Any]]] = []
        ordered = True  # every chunk after the ones before it (no record written twice)
        end = None
        for first, last, steps, vals, kind in self.conn.execute(query + " ORDER BY rowid", params):
            values = json.loads(vals)
            if kind:
                values = [decode(None, text) for text in values]
            iterations = range(first, last + 1) if steps is None else json.loads(steps)
            piece = list(zip(iterations, values))
            if stop is not None and last > stop:
                piece = [pair for pair in piece if pair[0] <= stop]
            if end is not None and first <= end:
                ordered = False
            end = last if end is None else max(end, last)
            pieces.append(piece)
        if ordered:
            return [pair for piece in pieces for pair in piece] if len(pieces) != 1 else pieces[0]
        merged: dict[int, Any] = {}
        for piece in pieces:  # in the order of writing: a later record wins
            merged.update(piece)
        return sorted(merged.items(), key=_first)

    def _key_names(self) -> dict[int, str]:
        return dict(self.conn.execute("SELECT id, name FROM keys"))

    def timeline(
        self, run: Run, keys: Sequence[str] = (), chain: bool = True, superseded: bool = False
    ) -> list[tuple[int, str, dict[str, Any]]]:
        """The run's log as ``(iteration, run_id, {key: value})`` rows in iteration order.

        With *chain*, a resumed run's rows follow those of the runs it resumed from: each
        ancestor contributes its rows up to the iteration its successor started at (rows it
        wrote past that point were redone by the successor and are left out); a row at that
        iteration merges both runs' records (the successor's win).
        """
        with _no_gc():  # ~1e5 new dicts and tuples, none cyclic: no collection passes over them
            return self._timeline(run, keys, chain, superseded)

    def _timeline(
        self, run: Run, keys: Sequence[str], chain: bool, superseded: bool
    ) -> list[tuple[int, str, dict[str, Any]]]:
        names = self._key_names()
        wanted = self._wanted(keys, names)
        if len(wanted) == 1:  # one key (log plot, log show --keys): one index range per run
            name = names[wanted[0]]
            return [
                (i, owner, {name: v}) for i, owner, v in self._chain_series(run, wanted[0], chain, superseded)
            ]
        runs = self.chain(run) if chain else [run]
        # Records come in iteration order, and each member's after its predecessor's (those end
        # where it started): rows are built in one pass, merging at the iteration they share.
        timeline: list[tuple[int, str, dict[str, Any]]] = []
        append = timeline.append
        newest, owner = -1, ""
        record: dict[str, Any] = {}
        for index, member in enumerate(runs):
            upto = runs[index + 1].start_iteration if index + 1 < len(runs) else None
            member_id = member.run_id
            for iteration, key, value in self.records(member_id, upto, keys, superseded):
                if iteration != newest:
                    if iteration < newest:  # out of order (not written by our plugin): sort
                        return self._timeline_unordered(runs, keys, superseded)
                    newest, owner, record = iteration, member_id, {}
                    append((iteration, owner, record))
                elif owner != member_id:  # the successor's row at the iteration it resumed at
                    owner = member_id
                    timeline[-1] = (iteration, owner, record)
                record[key] = value
        return timeline

    def series(
        self, run: Run, key: str, chain: bool = True, superseded: bool = False
    ) -> list[tuple[int, str, Any]]:
        """One key of the run's log as ``(iteration, run_id, value)`` in iteration order: the
        records of *key* in :meth:`timeline`, without building a dict per row."""
        ids = [i for i, name in self._key_names().items() if name == key]
        if not ids:
            return []
        with _no_gc():
            return self._chain_series(run, ids[0], chain, superseded)

    def _chain_series(self, run: Run, key: int, chain: bool, superseded: bool) -> list[tuple[int, str, Any]]:
        runs = self.chain(run) if chain else [run]
        found: list[tuple[int, str, Any]] = []
        for index, member in enumerate(runs):
            upto = runs[index + 1].start_iteration if index + 1 < len(runs) else None
            owner = member.run_id
            pairs = self._run_series(owner, key, upto, superseded)
            if found and pairs and pairs[0][0] <= found[-1][0]:
                if pairs[0][0] < found[-1][0]:  # not written by our plugin: merge and sort
                    return self._chain_series_unordered(runs, key, superseded)
                found.pop()  # the successor's record at the iteration it resumed at wins
            found += [(i, owner, v) for i, v in pairs]
        return found

    def _chain_series_unordered(
        self, runs: list[Run], key: int, superseded: bool
    ) -> list[tuple[int, str, Any]]:
        merged: dict[int, tuple[str, Any]] = {}
        for index, member in enumerate(runs):
            upto = runs[index + 1].start_iteration if index + 1 < len(runs) else None
            for i, v in self._run_series(member.run_id, key, upto, superseded):
                merged[i] = (member.run_id, v)
        return [(i, owner, v) for i, (owner, v) in sorted(merged.items(), key=_first)]

    def _timeline_unordered(
        self, runs: list[Run], keys: Sequence[str], superseded: bool
    ) -> list[tuple[int, str, dict[str, Any]]]:
        rows: dict[int, tuple[str, dict[str, Any]]] = {}
        for index, member in enumerate(runs):
            upto = runs[index + 1].start_iteration if index + 1 < len(runs) else None
            for iteration, key, value in self.records(member.run_id, upto, keys, superseded):
                owner, record = rows.setdefault(iteration, (member.run_id, {}))
                if owner != member.run_id:
                    rows[iteration] = (member.run_id, record)
                record[key] = value
        return [(iteration, owner, record) for iteration, (owner, record) in sorted(rows.items())]

    def keys(self, run_ids: Iterable[str]) -> list[str]:
        """The distinct keys recorded by these runs, sorted."""
        found: set[str] = set()
        for run_id in run_ids:
            found.update(
                name
                for (name,) in self.conn.execute(
                    "SELECT name FROM keys WHERE id IN (SELECT DISTINCT key FROM chunks WHERE run = "
                    "(SELECT num FROM runs WHERE run_id = ?))",
                    (run_id,),
                )
            )
        return sorted(found)


@contextlib.contextmanager
def _no_gc() -> Iterator[None]:
    """Pause the cyclic garbage collector: reading 1e5 rows builds 1e5 containers, and the
    collections their allocation triggers took half the time of ``log show --keys``."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _by_iteration_and_key(record: tuple[int, str, Any]) -> tuple[int, str]:
    return record[0], record[1]


def _first(pair: tuple[int, Any]) -> int:
    return pair[0]


def key_matcher(patterns: Sequence[str]) -> Callable[[str], bool]:
    """A predicate: does a key match any of the glob *patterns* (no patterns: every key)?"""
    if not patterns:
        return lambda key: True
    from fnmatch import fnmatchcase

    cache: dict[str, bool] = {}

    def match(key: str) -> bool:
        hit = cache.get(key)
        if hit is None:
            hit = cache[key] = any(fnmatchcase(key, p) for p in patterns)
        return hit

    return match


def finite(value: Any) -> float | None:
    """*value* as a float if it is a real finite-or-infinite number (not bool, not NaN), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return None if math.isnan(value) else value
