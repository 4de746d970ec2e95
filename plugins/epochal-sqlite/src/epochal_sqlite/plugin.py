"""The ``sqlite_log`` plugin: writes the training log of every run into a SQLite file.

The training log is a dict of rows keyed by iteration that the loop and the plugins fill
(``loop.log.current_row[key] = value``); there is no callback per record. The plugin keeps a
cursor: the iteration of the row it flushed last, and the records of that row it has written.
At each flush (every ``flush_every`` rows, every ``flush_seconds``, at each epoch end, at the
end of training, on an interrupt or an error) it writes the rows from the cursor to the current
iteration — for the cursor row only the records that are new or were re-assigned since — in one
transaction, together with the run's status: one ``chunks`` row per key (the key's values as a
JSON array, see :mod:`epochal_sqlite.store`), so a flush costs a few inserts, not one per
record. ``after_batch`` only compares two counters (and reads the monotonic clock), so the cost
per batch stays small.

Records written later into a row *before* the cursor row (a plugin writing into
``log[i - 100]``) are not picked up; every record written into the current row is.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shlex
import sqlite3
import sys
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from epochal import hookimpl
from epochal.protocol import NonNegativeFloat, NonNegativeInt, Phase, Rank, checked_options
from epochal_sqlite import store
from epochal_sqlite.liveness import RunLock, mark_killed

if TYPE_CHECKING:
    import click

    from epochal.loop import Loop

_V = TypeVar("_V")
#: the records of one flush, per key: ``key -> (iterations, values)``.
_Series = dict[str, tuple[list[int], list[_V]]]

_INSERT = "INSERT INTO chunks (run, key, first, last, steps, vals, kind) VALUES (?, ?, ?, ?, ?, ?, ?)"


#: the key of the stored configuration naming its file (no TOML section has this name).
CONFIG_FILE = "config_file"


def _config_document(loop: Loop) -> Any:
    """The run's configuration as stored, with the absolute path of its file when it has one
    (``epochal log runs`` shows it and ``--config`` selects by it)."""
    config, source = loop.config, loop.config_file
    if not isinstance(config, dict) or not isinstance(source, str) or source.startswith("<"):
        return config
    return {CONFIG_FILE: str(Path(source).resolve()), **config}


def default_path(run_dir: str | Path | None) -> Path:
    """The database a run in *run_dir* writes to when ``path`` is not set (see :class:`SQLiteLog`)."""
    if os.environ.get("EPOCHAL_SQLITE_DB"):
        return Path(os.environ["EPOCHAL_SQLITE_DB"])
    if run_dir is None:
        return Path("epochal.sqlite")
    return Path(run_dir).parent / "epochal.sqlite"


@checked_options("sqlite_log")
class SQLiteLog:
    """Persist every run's training log, status and configuration in a SQLite file.

    :param path: the database file. Default: ``$EPOCHAL_SQLITE_DB``, else ``epochal.sqlite``
        beside the configuration's ``[loop] run_dir`` (``runs/epochal.sqlite`` for
        ``runs/<config>``, whose runs are ``runs/<config>/version_N``: one log per project,
        shared by the runs of all its configs; each run row records its own directory), else
        ``epochal.sqlite`` in the working directory when the loop has no run directory. Many
        runs share one file.
    :param flush_every: write the buffered rows after this many training iterations (rows);
        0: never by count.
    :param flush_seconds: ... or when this many seconds passed since the last write (0: never
        by time). Rows are also written at every epoch end and when training ends.
    :param keys: glob patterns of the keys to record (``["valid.*", "train.loss"]``); None or
        empty: every key.
    """

    #: write after monitor, early stopping and checkpoint have logged the epoch's records.
    phase: ClassVar[Phase] = "report"  # the epoch's records and decisions are in the row
    writes_to = ("path",)  # the database (epochal check-resume moves it)
    #: on several processes one writer, rank 0 (the records it logs are reduced across ranks).
    rank: ClassVar[Rank] = "zero"

    def __init__(
        self,
        path: str | None = None,
        flush_every: NonNegativeInt = 1000,
        flush_seconds: NonNegativeFloat = 5.0,
        keys: list[str] | None = None,
    ) -> None:
        self.path = path
        self.flush_every = flush_every
        self.flush_seconds = float(flush_seconds)
        self._rows_due = flush_every or sys.maxsize  # rows buffered before a flush
        #: flushing only at epoch ends: nothing to do after a batch (see epochal's idle_hooks)
        self.idle_hooks = frozenset() if flush_every or flush_seconds else frozenset({"after_batch"})
        self.keys = list(keys or [])
        self._conn: sqlite3.Connection | None = None
        self._lock: RunLock | None = None
        self.db_path: Path | None = None
        self.run_id: str | None = None
        self._cursor = 0  # the iteration of the row flushed last
        self._written: dict[str, Any] = {}  # the records of the cursor row already written
        self._deadline = float("inf")
        self._status: dict[str, Any] = {}
        self._keep: dict[str, bool] = {}
        self._num = 0  # the run's integer number in the file (runs.num)
        self._key_ids: dict[str, int] = {}  # key name -> keys.id
        self._failed = False  # a write of this run failed (the error raised names the file)
        #: the number of records written by this run (for tests and benchmarks).
        self.records_written = 0

    # -- hooks --------------------------------------------------------------------------------

    @hookimpl
    def before_training(self, loop: Loop) -> None:
        """Open (create) the database and insert the run as ``running``."""
        self.close()
        # beside the config's run root, shared by all its runs (each in its own run_dir)
        db_path = default_path(loop.run_root) if self.path is None else Path(self.path)
        conn = store.connect(db_path, create=True)
        lock = RunLock(db_path, loop.run_id)
        kept = "nothing of this run was written; the runs it held are kept"
        try:
            with store.failures(db_path, "cannot log this run into", kept):
                self._start(conn, lock, db_path, loop)
        except BaseException:
            if conn.in_transaction:
                with contextlib.suppress(sqlite3.Error):  # SQLite may have rolled it back itself
                    conn.execute("ROLLBACK")
            conn.close()
            lock.release()
            raise
        self._conn, self._lock, self.db_path, self.run_id = conn, lock, db_path, loop.run_id
        self._failed = False
        self._keep = {}
        self.records_written = 0
        # A resumed run starts at the restored iteration; the restored row there was written by
        # the run that saved the state, so only records added to it from now on are new.
        self._cursor = loop.iteration
        self._written = dict(loop.log[loop.iteration]) if loop.iteration in loop.log else {}
        self._deadline = time.monotonic() + self.flush_seconds if self.flush_seconds else float("inf")

    def _start(self, conn: sqlite3.Connection, lock: RunLock, db_path: Path, loop: Loop) -> None:
        """Insert the run (``before_training``'s transaction)."""
        conn.execute("PRAGMA cache_size=-256")  # KiB: it only appends; keeps a long run's memory flat
        lock.acquire()
        mark_killed(conn, db_path)  # earlier runs of this file that were killed
        now = time.time()
        status = dict(loop.log.status)
        conn.execute("BEGIN IMMEDIATE")
        conn.execute(
            "INSERT INTO runs (run_id, started, updated, status, epochs_done, iterations_done, "
            "start_iteration, flushed_iteration, resumed_from, config, plugins, log_status, run_dir, "
            "host, pid, epochal_version) VALUES (?, ?, ?, 'running', ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                loop.run_id,
                now,
                now,
                loop.epoch,
                loop.iteration,
                loop.iteration,
                loop.iteration,
                loop.resumed_from,
                store.dumps(_config_document(loop)),
                store.dumps(_plugin_versions(loop)),
                store.dumps(status),
                None if loop.run_dir is None else str(loop.run_dir),
                _hostname(),
                os.getpid(),
                _epochal_version(),
            ),
        )
        conn.execute("UPDATE runs SET num = rowid WHERE run_id = ?", (loop.run_id,))
        (self._num,) = conn.execute("SELECT num FROM runs WHERE run_id = ?", (loop.run_id,)).fetchone()
        self._key_ids = dict(conn.execute("SELECT name, id FROM keys"))
        here = None if loop.run_dir is None else str(loop.run_dir)
        saved_in = conn.execute("SELECT run_dir FROM runs WHERE run_id = ?", (loop.resumed_from,)).fetchone()
        if loop.resumed_from is not None and (saved_in is None or saved_in[0] == here):
            # A run continued in its own directory (a resume after a crash or a stop): the rows
            # the run that saved the restored state wrote after it are not part of the history
            # of the model that was restored. Mark them, so that every view of that run (not
            # only the resumed chain) matches what training actually continued from. A branch
            # (`--resume PATH`, a directory of its own) leaves that run's history as it was.
            conn.execute(
                "UPDATE runs SET superseded_after = min(coalesce(superseded_after, ?), ?) WHERE run_id = ?",
                (loop.iteration, loop.iteration, loop.resumed_from),
            )
        conn.execute("COMMIT")
        self._status = status

    @hookimpl
    def after_batch(self, loop: Loop) -> None:
        """Flush when ``flush_every`` rows are buffered or ``flush_seconds`` have passed."""
        if loop.iteration - self._cursor >= self._rows_due or (
            self.flush_seconds and time.monotonic() >= self._deadline  # no clock read when 0
        ):
            self.flush(loop)

    @hookimpl
    def after_epoch(self, loop: Loop) -> None:
        """Flush the epoch's rows, with the records of evaluation and earlier plugins."""
        self.flush(loop)

    @hookimpl
    def on_interrupt(self, loop: Loop) -> None:
        """Flush what was logged before the interrupt (``after_training`` follows)."""
        self.flush(loop)

    @hookimpl
    def after_training(self, loop: Loop) -> None:
        """Flush the last rows, record the final status and close the database."""
        try:
            self.flush(loop, final=True)
        finally:
            self.close()

    @hookimpl
    def on_error(self, loop: Loop, error: BaseException) -> None:
        """Flush what was logged, record the run as failed with its error, close."""
        if self._conn is None:
            return
        try:
            # after its own write failed (the error being handled says so), one more try, and
            # none into a damaged file; a second failure would say the same again
            if not (self._failed and isinstance(error, store.DatabaseAccessError) and error.damaged):
                self.flush(loop, final=True, error=error)
        except Exception as secondary:
            if not self._failed:
                warnings.warn(
                    f"sqlite_log: could not record the failed run in {self.db_path}: {secondary}",
                    RuntimeWarning,
                    stacklevel=2,
                )
        finally:
            self.close()

    @staticmethod
    @hookimpl
    def register_commands(cli: click.Group) -> None:
        """Add ``epochal log runs|show|plot|compare``."""
        from epochal_sqlite.commands import log_group

        cli.add_command(log_group)

    @hookimpl
    def run_summary(self, loop: Loop) -> list[str]:
        """Where the log database is, and the command that plots this run's main metric (when
        the run logged one).

        On several machines the database is on rank 0's (its local disk: SQLite's WAL needs
        one), so the line names that machine too.
        """
        if self.db_path is None:
            return []
        where = str(self.db_path)
        if loop.world.several_nodes:  # the machine of rank 0 (torch's choice) holds this file
            where = f"{self.db_path.absolute()} (on {_hostname()}, the machine of rank 0)"
        key = _plot_key(loop)
        if key is None:  # no metric was logged (no batch trained): nothing to plot
            return [f"log: {where}"]
        plot = ["epochal", "log", "plot", loop.run_id[:12], "--db", str(self.db_path)]
        plot += ["--key", key, "-o", f"{key.replace('.', '-')}.png"]
        return [f"log: {where}", f"plot: {shlex.join(plot)}"]

    # -- writing ------------------------------------------------------------------------------

    def flush(self, loop: Loop, final: bool = False, error: BaseException | None = None) -> int:
        """Write the new records since the last flush and the run's status; return their count.

        One transaction: the records, the cursor (``flushed_iteration``) and the status are
        committed together or not at all.
        """
        conn = self._conn
        if conn is None:
            return 0
        end = loop.iteration
        numbers, texts, count = self._collect(loop)
        status = loop.log.status
        now = time.time()
        kept = (
            f"the runs it held are kept, and this run's records up to iteration {self._cursor}"
            if self.records_written or self._cursor
            else "the runs it held are kept"
        )
        try:
            with store.failures(self.db_path or "", "cannot write the training log", kept):
                new_ids = self._write(conn, loop, final, error, numbers, texts, status, now)
        except store.DatabaseAccessError:
            self._failed = True
            raise
        # committed: the records up to this row are in the file, the new keys' ids are real
        self._cursor = end
        self._written = dict(loop.log[end]) if end in loop.log else {}
        self._key_ids.update(new_ids)
        self._status = dict(status)
        self.records_written += count
        if self.flush_seconds:
            self._deadline = time.monotonic() + self.flush_seconds
        return count

    def _write(
        self,
        conn: sqlite3.Connection,
        loop: Loop,
        final: bool,
        error: BaseException | None,
        numbers: _Series[float],
        texts: _Series[str],
        status: Mapping[str, Any],
        now: float,
    ) -> dict[str, int]:
        """The transaction of :meth:`flush`; returns the ids of the keys it added."""
        end = loop.iteration
        conn.execute("BEGIN IMMEDIATE")
        try:
            # keys seen for the first time join this transaction (not a commit each); their ids
            # are kept only once it commits
            new_ids = self._new_key_ids([*numbers, *texts])
            if numbers or texts:
                run, known = self._num, self._key_ids
                ids = {**known, **new_ids} if new_ids else known
                chunks = [
                    store.chunk(run, ids[key], steps, values, 0) for key, (steps, values) in numbers.items()
                ]
                chunks += [
                    store.chunk(run, ids[key], steps, values, 1) for key, (steps, values) in texts.items()
                ]
                conn.executemany(_INSERT, chunks)
            if final or status != self._status:
                state = status.get("status", "running")
                if error is not None and state not in ("failed", "interrupted"):
                    state = "failed"
                conn.execute(
                    "UPDATE runs SET updated = ?, ended = ?, status = ?, finish_reason = ?, error = ?, "
                    "error_plugin = ?, epochs_done = ?, iterations_done = ?, flushed_iteration = ?, "
                    "log_status = ? WHERE run_id = ?",
                    (
                        now,
                        now if final else None,
                        state if final else "running",
                        status.get("finish_reason"),
                        status.get("error") or (f"{type(error).__name__}: {error}" if error else None),
                        loop.error_plugin if error is not None else None,
                        loop.epoch,
                        loop.iteration,
                        end,
                        store.dumps(status),
                        self.run_id,
                    ),
                )
            else:
                conn.execute(
                    "UPDATE runs SET updated = ?, epochs_done = ?, iterations_done = ?, "
                    "flushed_iteration = ? WHERE run_id = ?",
                    (now, loop.epoch, loop.iteration, end, self.run_id),
                )
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:  # SQLite rolls back by itself on some errors (a full disk)
                conn.execute("ROLLBACK")
            raise
        return new_ids

    def _collect(self, loop: Loop) -> tuple[_Series[float], _Series[str], int]:
        """The records from the cursor row to the current row, per key: the numbers and the JSON
        texts (``key -> (iterations, values)``), and their count. The cursor stays: the flush
        moves it once they are committed."""
        log = loop.log
        end = loop.iteration
        keep = self._keep
        patterns = self.keys
        encode = store.encode
        numbers: _Series[float] = {}
        texts: _Series[str] = {}
        written = self._written
        count = 0
        # peek: rows the log evicted already are read back without making them resident again
        for iteration, row in sorted(log.peek(range(self._cursor, end + 1)).items()):
            for key, value in row.items():
                if iteration == self._cursor and _same(written.get(key, _MISSING), value):
                    continue  # written by the last flush and not re-assigned since
                kept = keep.get(key)
                if kept is None:
                    kept = keep[key] = _keep(key, patterns)
                if not kept:
                    continue
                count += 1
                if type(value) is float and value - value == 0.0:  # finite: a number in JSON
                    series = numbers.get(key)
                    if series is None:
                        series = numbers[key] = ([], [])
                    series[0].append(iteration)
                    series[1].append(value)
                    continue
                number, text = encode(value)
                if number is not None and number - number == 0.0:
                    series = numbers.get(key)
                    if series is None:
                        series = numbers[key] = ([], [])
                    series[0].append(iteration)
                    series[1].append(number)
                else:
                    other = texts.get(key)
                    if other is None:
                        other = texts[key] = ([], [])
                    other[0].append(iteration)
                    other[1].append(text if text is not None else json.dumps(number))
        return numbers, texts, count

    def _new_key_ids(self, keys: list[str]) -> dict[str, int]:
        """The ids of the *keys* not yet in the ``keys`` table, added (once per key and file), in
        the caller's transaction."""
        assert self._conn is not None
        known = self._key_ids
        new = list(dict.fromkeys(key for key in keys if key not in known))
        if not new:
            return {}
        conn = self._conn
        conn.executemany("INSERT OR IGNORE INTO keys (name) VALUES (?)", [(key,) for key in new])
        found: dict[str, int] = {}
        for start in range(0, len(new), 500):  # within SQLite's limit on bound parameters
            part = new[start : start + 500]
            marks = ", ".join("?" * len(part))
            found.update(conn.execute(f"SELECT name, id FROM keys WHERE name IN ({marks})", part))
        return found

    def close(self) -> None:
        """Close the database and release the run's lock (the run stays as last flushed)."""
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if self._lock is not None:
            self._lock.release()
            self._lock = None


_MISSING = object()


def _plot_key(loop: Loop) -> str | None:
    """The metric a person plots first: an evaluation loss (else its first metric), else the
    training loss."""
    for stream, metrics in loop.last_metrics.items():
        if metrics:
            return f"{stream}.{'loss' if 'loss' in metrics else next(iter(metrics))}"
    for stream in loop.eval_streams:  # no evaluation in this run (nothing left to train): the log's
        if loop.log.last(f"{stream}.loss") is not None:
            return f"{stream}.loss"
    return "train.loss" if loop.log.last("train.loss") is not None else None


def _same(written: Any, value: Any) -> bool:
    """Whether *value* is the record the last flush wrote (the same object, or an equal copy
    of it that the log read back from its spill)."""
    if written is value:
        return True
    if written is _MISSING or type(written) is not type(value) or type(value) not in _SCALARS:
        return False
    return bool(written == value)


_SCALARS = frozenset({float, int, str, bool, bytes})


def _keep(key: str, patterns: list[str]) -> bool:
    if not patterns:
        return True
    from fnmatch import fnmatchcase

    return any(fnmatchcase(key, p) for p in patterns)


def _plugin_versions(loop: Loop) -> dict[str, str | None]:
    """``{plugin name: version}`` of the plugins of the run, in call order."""
    infos = {info.name: info for info in loop.plugin_set.infos}
    return {name: getattr(infos.get(name), "version", None) for name in loop.plugins}


def _hostname() -> str:
    import socket  # here: listing plugins (every CLI start) does not pay for it

    return socket.gethostname()


@functools.lru_cache(maxsize=1)
def _epochal_version() -> str | None:
    """epochal's installed version, looked up once per process (a metadata scan: ~1 ms per run)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("epochal")
    except PackageNotFoundError:  # pragma: no cover
        return None
