"""The database: schema, opening and checking a file, its errors as one line, run liveness.

One SQLite file holds many runs. Tables (schema version 3, ``PRAGMA user_version``, the only
one created and read; the file is marked as ours by ``PRAGMA application_id``):

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
    records are superseded; 0 in what this version writes, which sets ``superseded_after``).
    A flush writes one row per key, so a write costs a fraction of a row-per-record insert and
    one key of one run is one index range (``chunks_by_key``). A record written again later (a
    re-assigned record of the row being written) is in a later chunk, which wins: ``rowid`` is
    the order of writing. About 19 bytes a number.
``log`` (a view)
    one row per record: ``run_id``, ``iteration``, ``key`` (the name), ``value``,
    ``value_json``, ``superseded``; for reading with SQL (it unpacks the chunks: slower than
    :class:`epochal_sqlite.reader.Reader`, which reads only the chunks it needs).
``meta``
    ``key``/``value`` text pairs: ``created_by``, ``schema_version``.

Every metric name and value is a bound parameter, never part of the SQL text. Reading:
:mod:`epochal_sqlite.reader` (``store.Reader`` and ``store.Run`` name its classes too). Whether a
run's writer still runs: :mod:`epochal_sqlite.liveness` (its names are importable from here too).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from epochal.errors import EpochalError
from epochal_sqlite import liveness

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


def __getattr__(name: str) -> Any:
    """``store.Reader``, ``store.Run``, ``store.key_matcher``, ``store.finite``: the reading side,
    in :mod:`epochal_sqlite.reader` (imported when first named: it imports this module); and
    ``store.RunLock``, ``store.mark_killed``, ...: run liveness, in :mod:`epochal_sqlite.liveness`."""
    if name in ("Reader", "Run", "key_matcher", "finite"):
        from epochal_sqlite import reader

        return getattr(reader, name)
    if name in liveness.__all__:
        return getattr(liveness, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
