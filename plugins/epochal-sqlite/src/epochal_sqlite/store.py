"""The database: schema, migrations, opening and checking a file, run liveness, queries.

One SQLite file holds many runs. Tables (schema version 3, ``PRAGMA user_version``; the file
is marked as ours by ``PRAGMA application_id``; version 1 and 2 files are migrated when opened):

``runs``
    one row per run: ``run_id`` (the loop's fresh uuid hex), ``num`` (the run's integer number,
    what ``chunks`` refer to), ``started``/``ended``/``updated``
    (unix seconds), ``status`` (running, finished, interrupted, failed, killed),
    ``finish_reason``, ``error``, ``error_plugin``, ``epochs_done``, ``iterations_done``,
    ``start_iteration`` (the iteration the run started at: 0, or where it resumed),
    ``flushed_iteration`` (rows before it are all written), ``resumed_from`` (the run id whose
    saved state this run continued), ``config`` and ``plugins`` (JSON), ``log_status`` (the
    loop's ``log.status`` as JSON), ``run_dir``, ``host``, ``pid``, ``epochal_version``,
    ``superseded_after`` (the records of this run past this iteration are superseded: a later
    run resumed from a state this run saved there; NULL: none).
``keys``
    ``id``/``name``: every record key once (records hold the id, not the text).
``chunks``
    the records, one row per key and flush: ``run`` (``runs.num``), ``key`` (``keys.id``),
    ``first``/``last`` (the first and last iteration), ``steps`` (a JSON array of the
    iterations, NULL when they are every iteration from ``first`` to ``last``), ``vals`` (a JSON
    array of the values: numbers when ``kind`` is 0, else the JSON text of each value — strings,
    booleans, lists, NaN, infinities, integers beyond 2**53), ``superseded`` (1: all its
    records are superseded, from a version 2 file). A flush writes one row per key, so a write
    costs a fraction of a row-per-record insert and one key of one run is one index range
    (``chunks_by_key``). A record written again later (a re-assigned record of the row being
    written) is in a later chunk, which wins: ``rowid`` is the order of writing. About 19 bytes
    a number.
``log`` (a view)
    one row per record with version 1's columns: ``run_id``, ``iteration``, ``key`` (the name),
    ``value``, ``value_json``, ``superseded``; for reading with SQL (it unpacks the chunks:
    slower than :class:`Reader`, which reads only the chunks it needs).
``meta``
    ``key``/``value`` text pairs: ``created_by``, ``schema_version``.

Every metric name and value is a bound parameter, never part of the SQL text.
"""

from __future__ import annotations

import contextlib
import functools
import gc
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


class DatabaseAccessError(SQLiteLogError):
    """Reading or writing the file failed: it is damaged, the disk is full, it is read-only...

    ``code`` is SQLite's primary error code (``sqlite3.SQLITE_FULL``...), or None.
    """

    def __init__(self, message: str, code: int | None) -> None:
        super().__init__(message)
        self.code = code

    @property
    def damaged(self) -> bool:
        """The file is damaged: nothing more should be written into it."""
        return self.code in _DAMAGED


#: what a SQLite error means for the user, by primary error code.
_REASONS = {
    sqlite3.SQLITE_FULL: "the disk is full",
    sqlite3.SQLITE_CORRUPT: "the file is damaged",
    sqlite3.SQLITE_NOTADB: "the file is damaged",
    sqlite3.SQLITE_READONLY: "the file or its directory is read-only",
    sqlite3.SQLITE_IOERR: "an I/O error occurred",
    sqlite3.SQLITE_CANTOPEN: "the file cannot be opened",
    sqlite3.SQLITE_PERM: "permission denied",
    sqlite3.SQLITE_BUSY: "another process kept it locked",
    sqlite3.SQLITE_LOCKED: "another process kept it locked",
}
_DAMAGED = (sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB)


def failure(path: str | Path, error: sqlite3.Error, doing: str, kept: str) -> DatabaseAccessError:
    """One line for a SQLite *error* on *path*: what failed (*doing*), why, and what is *kept*:
    ``"{doing} {path}: the disk is full (database or disk is full); {kept}"``."""
    extended = getattr(error, "sqlite_errorcode", None)
    code = None if extended is None else extended & 0xFF
    reason = _REASONS.get(code, "SQLite failed") if code is not None else "SQLite failed"
    if code == sqlite3.SQLITE_IOERR and _no_space(Path(path).parent):
        reason = _REASONS[sqlite3.SQLITE_FULL]  # a -shm file that could not grow: an I/O error
    if code == sqlite3.SQLITE_CANTOPEN and not _writable(Path(path).parent):
        reason = "its directory is read-only"
    if code in _DAMAGED:  # what it held is what can still be read
        kept = f"nothing more was written into it (`sqlite3 {path} .recover` saves what can still be read)"
    return DatabaseAccessError(f"{doing} {path}: {reason} ({error}); {kept}", code)


def _no_space(directory: Path) -> bool:
    try:
        return os.statvfs(directory).f_bavail == 0
    except OSError:
        return False


@contextlib.contextmanager
def failures(path: str | Path, doing: str, kept: str) -> Iterator[None]:
    """Raise a SQLite error of the block as :func:`failure`'s one line (the error chained)."""
    try:
        yield
    except sqlite3.Error as error:
        raise failure(path, error, doing, kept) from error


# -- schema -------------------------------------------------------------------------------------


#: the schema version this code writes and reads (``PRAGMA user_version``); a file of any other
#: version is refused (versions 1 and 2 were never released: there is no migration).
SCHEMA_VERSION = 3


def _create_schema(conn: sqlite3.Connection) -> None:
    """An empty file → version :data:`SCHEMA_VERSION`: the tables, indexes and view."""
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
            epochal_version TEXT, num INTEGER, superseded_after INTEGER)"""
    )
    conn.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
    conn.execute("INSERT INTO meta VALUES ('created_by', ?)", (f"epochal-sqlite {_version()}",))
    conn.execute("CREATE UNIQUE INDEX runs_num ON runs (num)")
    conn.execute("CREATE TABLE keys (id INTEGER PRIMARY KEY, name TEXT NOT NULL UNIQUE)")
    conn.execute(
        """CREATE TABLE chunks (
            run INTEGER NOT NULL,
            key INTEGER NOT NULL,
            first INTEGER NOT NULL,
            last INTEGER NOT NULL,
            steps TEXT,
            vals TEXT NOT NULL,
            kind INTEGER NOT NULL DEFAULT 0,
            superseded INTEGER NOT NULL DEFAULT 0
        )"""
    )
    # (run, key) then rowid: one key of one run is one range, in the order of writing
    conn.execute("CREATE INDEX chunks_by_key ON chunks (run, key)")
    _create_log_view(conn)


def _create_log_view(conn: sqlite3.Connection) -> None:
    """``log``: one row per record (the one written last of each run, key and iteration)."""
    iteration = (
        "CASE WHEN c.steps IS NULL THEN c.first + j.key ELSE json_extract(c.steps, '$[' || j.key || ']') END"
    )
    conn.execute(
        f"""CREATE VIEW log AS
        SELECT run_id, iteration, key, value, value_json,
            (flagged OR iteration > coalesce(after, iteration)) AS superseded
        FROM (
            SELECT runs.run_id AS run_id, {iteration} AS iteration, keys.name AS key,
                CASE WHEN c.kind = 0 THEN j.value END AS value,
                CASE WHEN c.kind = 1 THEN j.value END AS value_json,
                c.superseded AS flagged, runs.superseded_after AS after,
                row_number() OVER (PARTITION BY c.run, c.key, {iteration} ORDER BY c.rowid DESC) AS newest
            FROM chunks AS c JOIN runs ON runs.num = c.run JOIN keys ON keys.id = c.key,
                json_each(c.vals) AS j
        )
        WHERE newest = 1"""
    )


def chunk(run: int, key: int, steps: list[int], values: list[Any], kind: int) -> tuple[Any, ...]:
    """The row of ``chunks`` (without ``superseded``) holding *values* recorded at *steps*
    (increasing iterations): finite floats (*kind* 0) or the JSON texts of values (*kind* 1)."""
    return run, key, steps[0], steps[-1], _steps_json(steps), json.dumps(values), kind


def _steps_json(steps: list[int]) -> str | None:
    """The ``steps`` of a chunk: None when *steps* (increasing) are every iteration in their range."""
    return None if steps[-1] - steps[0] + 1 == len(steps) else json.dumps(steps)


def initialize(conn: sqlite3.Connection, path: str | Path) -> bool:
    """Check the database of *conn*; when it is empty, create the schema. True: it was created.

    The schema is made in one ``BEGIN IMMEDIATE`` transaction (two processes opening a new
    file at once do not both create it).

    :raises ForeignDatabaseError: the file holds tables but is not marked as ours.
    :raises SchemaVersionError: the file's schema version is not :data:`SCHEMA_VERSION`.
    """
    if _check_identity(conn, path) == SCHEMA_VERSION:
        return False
    conn.execute("BEGIN IMMEDIATE")
    try:
        if _check_identity(conn, path) == SCHEMA_VERSION:  # another process created it meanwhile
            conn.execute("COMMIT")
            return False
        _create_schema(conn)
        conn.execute(f"PRAGMA application_id = {APPLICATION_ID:d}")
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION:d}")
        conn.execute("INSERT INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise
    return True


def _check_identity(conn: sqlite3.Connection, path: str | Path) -> int:
    """The file's schema version (0: an empty file), after checking that it is ours and current."""
    try:
        app = conn.execute("PRAGMA application_id").fetchone()[0]
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        tables = conn.execute("SELECT count(*) FROM sqlite_master").fetchone()[0]
    except sqlite3.DatabaseError as error:
        if getattr(error, "sqlite_errorcode", None) == sqlite3.SQLITE_NOTADB:
            raise NotADatabaseError(f"{path} is not a SQLite database ({error})") from None
        raise failure(path, error, "cannot open the training log", "it was left as it is") from error
    if app == 0 and version == 0 and tables == 0:
        return 0  # empty: a new file
    if app != APPLICATION_ID:
        raise ForeignDatabaseError(
            f"{path} is a SQLite database but not an epochal-sqlite log "
            f"(application_id {app:#x}, {tables} schema object(s)); choose another path"
        )
    if version != SCHEMA_VERSION:
        hint = (
            "upgrade epochal-sqlite"
            if version > SCHEMA_VERSION
            else "it was written by an unreleased development version; start a new log file"
        )
        raise SchemaVersionError(
            f"{path} has log schema version {version}, "
            f"{'newer than' if version > SCHEMA_VERSION else 'not'} the version {SCHEMA_VERSION} "
            f"this epochal-sqlite ({_version()}) reads; {hint}"
        )
    return int(version)


def connect(path: str | Path, *, create: bool) -> sqlite3.Connection:
    """Open the database at *path* for writing (with *create*, create it first), checked.

    The connection is in autocommit mode (``isolation_level=None``): callers open their own
    transactions. WAL journal, ``synchronous=NORMAL``.

    :raises DatabaseNotFoundError: *path* does not exist (without *create*) or is a directory.
    :raises NotADatabaseError: *path* is not a SQLite file.
    :raises ForeignDatabaseError: *path* is a SQLite file of something else.
    :raises SchemaVersionError: *path* has another schema version than :data:`SCHEMA_VERSION`.
    :raises DatabaseAccessError: it cannot be created or opened (disk full, damaged, read-only...).
    """
    path = _existing(path, create)
    if create and not path.exists():
        try:
            _create_file(path)
        except OSError as error:
            raise DatabaseAccessError(
                f"cannot create the training log {path}: {error.strerror or error} "
                f"({error.filename or path}); nothing was written",
                None,
            ) from error
        except sqlite3.Error as error:
            raise failure(path, error, "cannot create the training log", "nothing was written") from error
    try:
        uri = f"file:{_quote(path)}?mode=rw"
        conn = sqlite3.connect(uri, uri=True, timeout=BUSY_TIMEOUT, isolation_level=None)
    except sqlite3.Error as error:
        raise DatabaseNotFoundError(f"cannot open database {path}: {error}") from None
    try:
        with failures(path, "cannot open the training log", "it was left as it is"):
            if not create and _check_identity(conn, path) == 0:
                raise ForeignDatabaseError(f"{path} is an empty SQLite database, not an epochal-sqlite log")
            initialize(conn, path)
            mode = conn.execute("PRAGMA journal_mode").fetchone()[0]
            if mode != "wal":
                conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
    except BaseException:
        conn.close()
        raise
    return conn


def connect_readonly(path: str | Path) -> sqlite3.Connection:
    """Open the database at *path* for reading only, checked (nothing is written, ever).

    ``mode=ro``; when its directory is not writable (read-only media) and no write-ahead log
    is beside it, ``immutable=1``: SQLite then needs no ``-shm`` file, which it could not create.
    With a write-ahead log it must read, a ``-shm`` file must be there already.

    :raises: as :func:`connect`, and :class:`DatabaseAccessError` when it cannot be read.
    """
    path = _existing(path, create=False)
    wal = path.with_name(path.name + "-wal")
    immutable = not _writable(path.parent) and not (wal.exists() and wal.stat().st_size > 0)
    uri = f"file:{_quote(path)}?mode=ro" + ("&immutable=1" if immutable else "")
    try:
        conn = sqlite3.connect(uri, uri=True, timeout=BUSY_TIMEOUT, isolation_level=None)
    except sqlite3.Error as error:
        raise DatabaseNotFoundError(f"cannot open database {path}: {error}") from None
    try:
        with failures(path, "cannot read the training log", "it was left as it is"):
            if _check_identity(conn, path) == 0:
                raise ForeignDatabaseError(f"{path} is an empty SQLite database, not an epochal-sqlite log")
    except BaseException:
        conn.close()
        raise
    return conn


def _existing(path: str | Path, create: bool) -> Path:
    path = Path(path)
    if path.is_dir():
        raise DatabaseNotFoundError(f"{path} is a directory, not an epochal-sqlite database file")
    if not create and not path.exists():
        raise DatabaseNotFoundError(f"no such database file: {path}")
    return path


def _writable(path: Path) -> bool:
    """Whether this process may write *path* (False on a read-only mount, for root too)."""
    return os.access(path, os.W_OK)


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
            # a private file until the link below, discarded if anything fails: no journal while
            # the schema is made (no -wal/-shm files made, checkpointed and deleted), and its one
            # fsync below stands for the schema's commits' own. WAL is switched on last: the mode
            # is kept in the file's header.
            conn.execute("PRAGMA synchronous=OFF")
            conn.execute("PRAGMA journal_mode=OFF")
            initialize(conn, temp)
            if conn.execute("PRAGMA journal_mode=WAL").fetchone()[0] != "wal":
                raise sqlite3.OperationalError(f"cannot switch {temp} to WAL mode")
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


@functools.lru_cache(maxsize=1)
def _version() -> str:
    """epochal-sqlite's installed version, looked up once per process (a metadata scan: ~0.1 ms)."""
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
        fd = os.open(path, os.O_RDONLY)  # enough for flock, and possible on read-only media
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing releases our lock if we took it
    return False


def dead_runs(conn: sqlite3.Connection, db: str | Path) -> list[str]:
    """The ``running`` runs of *conn* whose writer is gone (killed or crashed)."""
    running = [r for (r,) in conn.execute("SELECT run_id FROM runs WHERE status = 'running'")]
    return [run_id for run_id in running if writer_alive(db, run_id) is False]


def killed_reason(found: float) -> str:
    """The ``finish_reason`` of a run marked killed at *found* (unix seconds)."""
    return "the writing process ended without closing the run (killed or crashed); found " + time.strftime(
        "%Y-%m-%d %H:%M:%S", time.localtime(found)
    )


def mark_killed(conn: sqlite3.Connection, db: str | Path) -> list[str]:
    """Mark every ``running`` run whose writer is gone as ``killed``; return their ids.

    The update is conditional (``AND status = 'running'``) and runs after the lock check, so a
    run that finished cleanly in the meantime (its final status is committed before its lock
    is released) is never marked. A read-only file is left as it is.
    """
    dead = dead_runs(conn, db)
    if not dead:
        return []
    reason = killed_reason(time.time())
    try:
        conn.execute("BEGIN IMMEDIATE")
        for run_id in dead:
            conn.execute(
                "UPDATE runs SET status = 'killed', ended = coalesce(updated, started), "
                "finish_reason = ? WHERE run_id = ? AND status = 'running'",
                (reason, run_id),
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

    def close(self) -> None:
        """Close the connection; where the file is writable, mark the killed runs found in it
        and remove the ``-wal``/``-shm`` files the reading left (a read-only connection
        cannot), unless another connection uses them."""
        self.conn.close()
        if not (self._killed or self._tidy) or not (_writable(self.path) and _writable(self.path.parent)):
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

    def __exit__(self, *exc: object) -> None:
        self.close()

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
