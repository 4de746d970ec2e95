"""Run liveness: a lock file per running run, and marking the runs whose writer is gone.

The writing process holds an exclusive ``flock`` on ``<db>.locks/<run_id>.lock`` for as long as
its run runs (:class:`RunLock`). The kernel releases it when the process ends, however it ends,
so a ``running`` run whose lock can be taken was killed or crashed: :func:`mark_killed` marks it
``killed`` in the database, and readers show it so (:func:`dead_runs`, :func:`killed_reason`).
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import time
from pathlib import Path

__all__ = ["RunLock", "dead_runs", "killed_reason", "lock_path", "mark_killed", "writer_alive"]


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
