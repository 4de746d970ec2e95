"""The database: schema, migrations, opening and checking a file, run liveness, queries.

One SQLite file holds many runs. Tables (schema version 2, ``PRAGMA user_version``; the file
is marked as ours by ``PRAGMA application_id``; version 1 files are migrated when opened):

``runs``
    one row per run: ``run_id`` (the loop's fresh uuid hex), ``num`` (the run's integer number,
    what ``records`` refer to), ``started``/``ended``/``updated``
    (unix seconds), ``status`` (running, finished, interrupted, failed, killed),
    ``finish_reason``, ``error``, ``error_plugin``, ``epochs_done``, ``iterations_done``,
    ``start_iteration`` (the iteration the run started at: 0, or where it resumed),
    ``flushed_iteration`` (rows before it are all written), ``resumed_from`` (the run id whose
    saved state this run continued), ``config`` and ``plugins`` (JSON), ``log_status`` (the
    loop's ``log.status`` as JSON), ``run_dir``, ``host``, ``pid``, ``epochal_version``.
``keys``
    ``id``/``name``: every record key once (records hold the id, not the text).
``records``
    one row per record: ``run`` (``runs.num``), ``key`` (``keys.id``), ``iteration``, ``value``
    (REAL for numbers), ``value_json`` (JSON for any other value, and for NaN), ``superseded``
    (1 for rows a run wrote past the point a resumed run restarted from). Primary key
    ``(run, key, iteration)``, clustered (``WITHOUT ROWID``): one key of one run is one range,
    and a record re-written with a new value replaces the old one. About 25 bytes a number.
``log`` (a view)
    the records with version 1's columns: ``run_id``, ``iteration``, ``key`` (the name),
    ``value``, ``value_json``, ``superseded``; for reading with SQL.
``meta``
    ``key``/``value`` text pairs: ``created_by``, ``schema_version``.

Every metric name and value is a bound parameter, never part of the SQL text.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sqlite3
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from epochal.errors import EpochalError

#: ``PRAGMA application_id`` of our files: "EPCH".
APPLICATION_ID = 0x45504348
#: how long a connection waits for another writer's lock before failing.
BUSY_TIMEOUT = 30.0

STATUSES = ("running", "finished", "interrupted", "failed", "killed")


class SQLiteLogError(EpochalError):
    """A problem with an epochal-sqlite database or a query of it (the CLI prints one line)."""


class DatabaseNotFoundError(SQLiteLogError):
    """The database file does not exist, or no database could be found."""


class NotADatabaseError(SQLiteLogError):
    """The file exists but is not a SQLite database."""


class ForeignDatabaseError(SQLiteLogError):
    """The file is a SQLite database, but not one written by epochal-sqlite."""


class SchemaVersionError(SQLiteLogError):
    """The file was written by a newer epochal-sqlite whose schema this version cannot read."""


class UnknownRunError(SQLiteLogError):
    """No run (or more than one run) matches the run id or prefix given."""


# -- schema and migrations ----------------------------------------------------------------------


def _create_v1(conn: sqlite3.Connection) -> None:
    """Version 0 (an empty file) → 1: create the tables."""
    conn.execute(
        """CREATE TABLE runs (
            run_id TEXT PRIMARY KEY,
            started REAL NOT NULL,
            ended REAL,
            updated REAL,
            status TEXT NOT NULL,
            finish_reason TEXT,
            error TEXT,
            error_plugin TEXT,
            epochs_done INTEGER NOT NULL DEFAULT 0,
            iterations_done INTEGER NOT NULL DEFAULT 0,
            start_iteration INTEGER NOT NULL DEFAULT 0,
            flushed_iteration INTEGER NOT NULL DEFAULT 0,
            resumed_from TEXT,
            config TEXT,
            plugins TEXT,
            log_status TEXT,
            run_dir TEXT,
            host TEXT,
            pid INTEGER,
            epochal_version TEXT
        )"""
    )
    conn.execute(
        """CREATE TABLE log (
            run_id TEXT NOT NULL,
            iteration INTEGER NOT NULL,
            key TEXT NOT NULL,
            value REAL,
            value_json TEXT,
            superseded INTEGER NOT NULL DEFAULT 0,
            PRIMARY KEY (run_id, iteration, key)
        ) WITHOUT ROWID"""
    )
    conn.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
    conn.execute("INSERT INTO meta VALUES ('created_by', ?)", (f"epochal-sqlite {_version()}",))


def _compact_v2(conn: sqlite3.Connection) -> None:
    """Version 1 → 2: records keyed by integers (run number, iteration, key id), ~25 bytes a row.

    ``runs.num`` numbers the runs; ``keys`` interns the key names; ``records`` holds the rows
    with the primary key ``(run, key, iteration)`` (``WITHOUT ROWID``), so one key of one run is
    one range (``log show --keys``, ``log plot``) and a run's rows are one range too. The rows of
    version 1's ``log`` table are copied over; ``log`` becomes a view with the old columns, so
    SQL written against version 1 still reads.
    """
    conn.execute("ALTER TABLE runs ADD COLUMN num INTEGER")
    conn.execute("UPDATE runs SET num = rowid")
    conn.execute("CREATE UNIQUE INDEX runs_num ON runs (num)")
    conn.execute("CREATE TABLE keys (id INTEGER PRIMARY KEY, name TEXT NOT NULL UNIQUE)")
    conn.execute(
        """CREATE TABLE records (
            run INTEGER NOT NULL,
            key INTEGER NOT NULL,
            iteration INTEGER NOT NULL,
            value REAL,
            value_json TEXT,
            superseded INTEGER NOT NULL DEFAULT 0,
            PRIMARY KEY (run, key, iteration)
        ) WITHOUT ROWID"""
    )
    conn.execute("INSERT INTO keys (name) SELECT DISTINCT key FROM log ORDER BY key")
    conn.execute(
        "INSERT INTO records SELECT runs.num, keys.id, log.iteration, log.value, log.value_json, "
        "log.superseded FROM log JOIN runs ON runs.run_id = log.run_id JOIN keys ON keys.name = log.key"
    )
    conn.execute("DROP TABLE log")
    conn.execute(
        "CREATE VIEW log AS SELECT runs.run_id AS run_id, records.iteration AS iteration, "
        "keys.name AS key, records.value AS value, records.value_json AS value_json, "
        "records.superseded AS superseded FROM records "
        "JOIN runs ON runs.num = records.run JOIN keys ON keys.id = records.key"
    )


#: ``MIGRATIONS[v]`` upgrades a file of schema version ``v`` to ``v + 1``, inside the transaction
#: that also sets ``user_version``. Version 0 is an empty file. A new schema version appends a
#: step here (e.g. ``ALTER TABLE runs ADD COLUMN ...``); :data:`SCHEMA_VERSION` follows.
MIGRATIONS: list[Callable[[sqlite3.Connection], None]] = [_create_v1, _compact_v2]
#: the schema version this code writes (and the newest it reads).
SCHEMA_VERSION = len(MIGRATIONS)


def migrate(conn: sqlite3.Connection, path: str | Path, target: int | None = None) -> int:
    """Bring the database of *conn* up to schema version *target* (default: the latest).

    Runs every pending step of :data:`MIGRATIONS` in one ``BEGIN IMMEDIATE`` transaction (two
    processes opening a new file at once do not both create it). Returns the version before.

    :raises ForeignDatabaseError: the file holds tables but is not marked as ours.
    :raises SchemaVersionError: the file's version is newer than this code knows.
    """
    target = len(MIGRATIONS) if target is None else target
    version = _check_identity(conn, path)
    if version >= target:
        return version
    conn.execute("BEGIN IMMEDIATE")
    try:
        version = _check_identity(conn, path)  # another process may have migrated meanwhile
        for step in MIGRATIONS[version:target]:
            step(conn)
        conn.execute(f"PRAGMA application_id = {APPLICATION_ID:d}")
        conn.execute(f"PRAGMA user_version = {target:d}")
        conn.execute("INSERT OR REPLACE INTO meta VALUES ('schema_version', ?)", (str(target),))
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    return version


def _check_identity(conn: sqlite3.Connection, path: str | Path) -> int:
    """The file's schema version, after checking that it is ours (or empty) and not too new."""
    try:
        app = conn.execute("PRAGMA application_id").fetchone()[0]
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        tables = conn.execute("SELECT count(*) FROM sqlite_master").fetchone()[0]
    except sqlite3.DatabaseError as error:
        raise NotADatabaseError(f"{path} is not a SQLite database ({error})") from None
    if app == 0 and version == 0 and tables == 0:
        return 0  # empty: a new file
    if app != APPLICATION_ID:
        raise ForeignDatabaseError(
            f"{path} is a SQLite database but not an epochal-sqlite log "
            f"(application_id {app:#x}, {tables} schema object(s)); choose another path"
        )
    if version > len(MIGRATIONS):
        raise SchemaVersionError(
            f"{path} has log schema version {version}, newer than this epochal-sqlite "
            f"({_version()}) reads (up to {len(MIGRATIONS)}); upgrade epochal-sqlite"
        )
    return int(version)


def connect(path: str | Path, *, create: bool) -> sqlite3.Connection:
    """Open (and with *create*, create) the database at *path*, checked and migrated.

    The connection is in autocommit mode (``isolation_level=None``): callers open their own
    transactions. WAL journal, ``synchronous=NORMAL``.

    :raises DatabaseNotFoundError: *path* does not exist (without *create*) or is a directory.
    :raises NotADatabaseError: *path* is not a SQLite file.
    :raises ForeignDatabaseError: *path* is a SQLite file of something else.
    :raises SchemaVersionError: *path* was written by a newer version.
    """
    path = Path(path)
    if path.is_dir():
        raise DatabaseNotFoundError(f"{path} is a directory, not an epochal-sqlite database file")
    if not create and not path.exists():
        raise DatabaseNotFoundError(f"no such database file: {path}")
    if create and not path.exists():
        _create_file(path)
    uri = f"file:{_quote(path)}?mode=rw"
    try:
        conn = sqlite3.connect(uri, uri=True, timeout=BUSY_TIMEOUT, isolation_level=None)
    except sqlite3.Error as error:
        raise DatabaseNotFoundError(f"cannot open database {path}: {error}") from None
    try:
        if not create and _check_identity(conn, path) == 0:
            raise ForeignDatabaseError(f"{path} is an empty SQLite database, not an epochal-sqlite log")
        migrate(conn, path)
        mode = conn.execute("PRAGMA journal_mode").fetchone()[0]
        if mode != "wal":
            conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
    except sqlite3.DatabaseError as error:
        conn.close()
        raise NotADatabaseError(f"{path} is not a usable SQLite database ({error})") from None
    except BaseException:
        conn.close()
        raise
    return conn


def _create_file(path: Path) -> None:
    """Create a new database beside *path* and move it into place whole.

    Readers polling for the file never see it half-made: it appears with its schema, in WAL
    mode. When another process created it first, its file is kept.
    """
    missing = [p for p in (path.parent, *path.parent.parents) if not p.is_dir()]
    for directory in reversed(missing):
        directory.mkdir(exist_ok=True)
        _fsync_dir(directory.parent)
    temp = path.with_name(f".{path.name}.{os.getpid()}.new")
    try:
        conn = sqlite3.connect(temp, isolation_level=None)
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            migrate(conn, temp)
        finally:
            conn.close()
        with open(temp, "rb") as file:  # its bytes on disk before its name is
            os.fsync(file.fileno())
        try:
            os.link(temp, path)  # fails if the file exists now: never replace another's file
        except FileExistsError:
            pass
        except OSError:  # a filesystem without hard links
            if not path.exists():
                os.replace(temp, path)
        _fsync_dir(path.parent)  # the new name survives a power loss
    finally:
        for leftover in (temp, temp.with_name(temp.name + "-wal"), temp.with_name(temp.name + "-shm")):
            with contextlib.suppress(OSError):
                leftover.unlink()


def _fsync_dir(directory: Path) -> None:
    """Make the entries just created in *directory* durable (no-op where directories cannot be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # pragma: no cover - Windows
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover - filesystems that refuse fsync on directories
        pass
    finally:
        os.close(fd)


def _quote(path: Path) -> str:
    from urllib.parse import quote

    return quote(str(path.absolute()))


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("epochal-sqlite")
    except PackageNotFoundError:  # pragma: no cover - source tree
        return "0+unknown"


# -- values -------------------------------------------------------------------------------------


def encode(value: Any) -> tuple[float | None, str | None]:
    """``(value, value_json)`` for a log value: numbers as REAL, anything else as JSON.

    NaN goes to JSON (SQLite stores a NaN REAL as NULL); integers beyond 2**53 too (a REAL
    would round them); booleans too (so they read back as booleans). A value JSON cannot
    represent is stored as its ``str()``.
    """
    kind = type(value)
    if kind is float:
        return (value, None) if value == value else (None, "NaN")
    if kind is int:
        return (float(value), None) if -(2**53) <= value <= 2**53 else (None, str(value))
    if kind is not bool and kind is not str:
        item = getattr(value, "item", None)  # numpy scalars and 0-d arrays
        if item is not None and getattr(value, "ndim", None) == 0:
            return encode(item())
        tolist = getattr(value, "tolist", None)
        if tolist is not None:
            value = tolist()
    return None, json.dumps(value, default=str, allow_nan=True)


def decode(value: float | None, value_json: str | None) -> Any:
    """The Python value of a stored record."""
    if value_json is None:
        return value
    try:
        return json.loads(value_json)
    except ValueError:
        return value_json


def dumps(value: Any) -> str:
    """JSON of a config or status (anything not JSON-able as its ``str()``)."""
    return json.dumps(value, default=_default, sort_keys=False)


def _default(value: Any) -> Any:
    tolist = getattr(value, "tolist", None)
    return tolist() if tolist is not None else str(value)


# -- run liveness: a lock per running run -------------------------------------------------------


def lock_path(db: str | Path, run_id: str) -> Path:
    """The lock file a running run holds (``<db>.locks/<run_id>.lock``)."""
    db = Path(db)
    return db.with_name(db.name + ".locks") / f"{run_id}.lock"


class RunLock:
    """An exclusive ``flock`` held by the writing process for as long as its run runs.

    The kernel releases it when the process ends however it ends (kill -9 included), so a
    ``running`` run whose lock can be taken has no writer left: it was killed.
    """

    def __init__(self, db: str | Path, run_id: str) -> None:
        self.path = lock_path(db, run_id)
        self._fd: int | None = None

    def acquire(self) -> None:
        """Create and lock the file (no-op where ``fcntl`` does not exist)."""
        try:
            import fcntl
        except ImportError:  # pragma: no cover - Windows: no liveness check
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd

    def release(self) -> None:
        """Remove the file and release the lock (idempotent)."""
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            self.path.unlink()
        with contextlib.suppress(OSError):
            self.path.parent.rmdir()  # only when empty
        os.close(self._fd)
        self._fd = None


def writer_alive(db: str | Path, run_id: str) -> bool | None:
    """Whether a process still holds *run_id*'s lock (None: cannot tell on this platform)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover
        return None
    path = lock_path(db, run_id)
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing releases our lock if we took it
    return False


def mark_killed(conn: sqlite3.Connection, db: str | Path) -> list[str]:
    """Mark every ``running`` run whose writer is gone as ``killed``; return their ids.

    The update is conditional (``AND status = 'running'``) and runs after the lock check, so a
    run that finished cleanly in the meantime (its final status is committed before its lock
    is released) is never marked. A read-only file is left as it is.
    """
    running = [r for (r,) in conn.execute("SELECT run_id FROM runs WHERE status = 'running'")]
    dead = [run_id for run_id in running if writer_alive(db, run_id) is False]
    if not dead:
        return []
    now = time.time()
    try:
        conn.execute("BEGIN IMMEDIATE")
        for run_id in dead:
            conn.execute(
                "UPDATE runs SET status = 'killed', ended = coalesce(updated, started), "
                "finish_reason = 'the writing process ended without closing the run (killed or crashed); "
                "found ' || ? WHERE run_id = ? AND status = 'running'",
                (time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now)), run_id),
            )
        conn.execute("COMMIT")
    except sqlite3.OperationalError:  # read-only file or directory: report, do not persist
        with contextlib.suppress(sqlite3.Error):
            conn.execute("ROLLBACK")
        return dead
    for run_id in dead:
        stale = lock_path(db, run_id)
        with contextlib.suppress(OSError):
            stale.unlink()
        with contextlib.suppress(OSError):
            stale.parent.rmdir()
    return dead


# -- reading ------------------------------------------------------------------------------------


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
        self.conn = connect(self.path, create=False)
        mark_killed(self.conn, self.path)

    def close(self) -> None:
        """Close the connection."""
        self.conn.close()

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def runs(self) -> list[Run]:
        """Every run, oldest first."""
        query = f"SELECT {_RUN_COLUMNS} FROM runs ORDER BY started, run_id"
        return [_run(row) for row in self.conn.execute(query)]

    def get(self, run_id: str) -> Run | None:
        """The run with exactly this id, or None."""
        row = self.conn.execute(f"SELECT {_RUN_COLUMNS} FROM runs WHERE run_id = ?", (run_id,)).fetchone()
        return _run(row) if row else None

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
            return _run(row)
        exact = self.get(ref)
        if exact is not None:
            return exact
        # A prefix match with bound parameters: range of ids between ref and ref + U+FFFF.
        rows = self.conn.execute(
            f"SELECT {_RUN_COLUMNS} FROM runs WHERE run_id >= ? AND run_id < ? ORDER BY started",
            (ref, ref + "\uffff"),
        ).fetchall()
        if len(rows) == 1 and ref:
            return _run(rows[0])
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

        Rows marked superseded (written after the point a later run resumed from) are left out
        unless *superseded* is true.
        """
        run = self._num(run_id)
        names = self._key_names()
        match = key_matcher(keys)
        wanted = [i for i, name in names.items() if match(name)]
        if run is None or not wanted:
            return
        # one range of the primary key per key: only the wanted keys' rows are read
        query = "SELECT iteration, key, value, value_json FROM records WHERE run = ? AND key = ?"
        if not superseded:
            query += " AND superseded = 0"
        if upto is not None:
            query += " AND iteration <= ?"
        found: list[tuple[int, int, float | None, str | None]] = []
        for key in wanted:
            params = (run, key) if upto is None else (run, key, upto)
            found.extend(self.conn.execute(query, params))
        if len(wanted) > 1:  # in iteration order, then by key name (as version 1 read them)
            found.sort(key=lambda row: (row[0], names[row[1]]))
        for iteration, key, value, value_json in found:
            yield iteration, names[key], decode(value, value_json)

    def _num(self, run_id: str) -> int | None:
        row = self.conn.execute("SELECT num FROM runs WHERE run_id = ?", (run_id,)).fetchone()
        return None if row is None else row[0]

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
        runs = self.chain(run) if chain else [run]
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
        names = self._key_names()
        for run_id in run_ids:
            run = self._num(run_id)
            if run is None:
                continue
            # one probe of the primary key per known key (keys are few, rows are many)
            for key, name in names.items():
                if (
                    name not in found
                    and self.conn.execute(
                        "SELECT 1 FROM records WHERE run = ? AND key = ? LIMIT 1", (run, key)
                    ).fetchone()
                ):
                    found.add(name)
        return sorted(found)


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
