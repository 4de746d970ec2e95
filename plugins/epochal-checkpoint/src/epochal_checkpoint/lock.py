"""The lock a run holds on its checkpoint directory, so that two runs never write one directory.

The lock is an OS file lock (:mod:`filelock`: ``flock`` on POSIX, ``LockFileEx`` on Windows) on
``<dir>/.epochal-lock``; the kernel drops it when the holder dies, however it dies, so the lock
of a dead process (kill -9, power loss) is simply free and the next run takes it over. Who holds
it is written beside it in ``.epochal-lock.json`` (pid, host, run id, since when) for the error
a second run prints; that file says nothing about whether the lock is held, only the OS lock does.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import warnings
from pathlib import Path
from typing import Any

from epochal_checkpoint.errors import CheckpointLockedError, CheckpointWriteError

LOCK = ".epochal-lock"
HOLDER = ".epochal-lock.json"


def _describe(holder: Any) -> str:
    if not isinstance(holder, dict):
        return "another run (its details are unreadable)"
    return (
        f"run {holder.get('run_id')!s:.40} (pid {holder.get('pid')!s:.12} on host "
        f"{holder.get('host')!s:.80}, since {holder.get('since')!s:.40})"
    )


def _read_holder(directory: Path) -> Any:
    try:
        with open(directory / HOLDER, "rb") as file:
            return json.loads(file.read(4096))
    except (OSError, ValueError):
        return None


def live_holder(directory: Path) -> str | None:
    """Who holds the lock of *directory* now, described (None: no live run holds it).

    The OS lock is tried without waiting and dropped at once; no lock file is created where
    none exists (a directory no run ever locked has no live run).
    """
    if not (directory / LOCK).is_file():
        return None
    import filelock

    probe = filelock.FileLock(directory / LOCK, timeout=0, thread_local=False)
    try:
        probe.acquire(timeout=0)
    except filelock.Timeout:
        return _describe(_read_holder(directory))
    except OSError:  # cannot even open it (permissions): the lock itself will say so
        return None
    probe.release(force=True)
    return None


class DirectoryLock:
    """An exclusive lock on a checkpoint directory for the run *run_id*."""

    def __init__(self, directory: Path, run_id: str, plugin: str = "checkpoint") -> None:
        self.directory = directory
        self.run_id = run_id
        #: the name of the plugin (of this run) that takes the lock.
        self.plugin = plugin
        import filelock  # here: importing the plugin (every CLI start) does not pay for it

        self._timeout = filelock.Timeout
        self._lock = filelock.FileLock(directory / LOCK, timeout=0, thread_local=False)

    @property
    def held(self) -> bool:
        """Whether this object holds the lock."""
        return self._lock.is_locked

    def acquire(self) -> None:
        """Take the lock, or raise one error naming its holder.

        :raises CheckpointLockedError: another live run (process) holds the lock.
        :raises CheckpointWriteError: the lock file cannot be created.
        """
        if self.held:
            return
        try:
            self._lock.acquire(timeout=0)
        except self._timeout:
            holder = _read_holder(self.directory)
            if (
                isinstance(holder, dict)
                and holder.get("run_id") == self.run_id
                and holder.get("pid") == os.getpid()
            ):
                other = holder.get("plugin", "another checkpoint plugin")
                raise CheckpointLockedError(
                    f"checkpoint directory {str(self.directory)!r} is written by two plugins of this run, "
                    f"{other!r} and {self.plugin!r} (a composite's checkpoint beside the standard one, "
                    f"say): give one its own directory ([plugins.{self.plugin}] dir) or leave one out "
                    f"(--disable {self.plugin})"
                ) from None
            who = _describe(holder)
            raise CheckpointLockedError(
                f"checkpoint directory {str(self.directory)!r} is in use by {who}; "
                "two runs must not write one directory (wait for it, stop it, or set "
                "[plugins.checkpoint] dir / [loop] run_dir to another directory)"
            ) from None
        except OSError as error:
            raise CheckpointWriteError(
                f"cannot lock checkpoint directory {str(self.directory)!r}: {error.strerror or error}"
            ) from None
        stale = _read_holder(self.directory)
        if isinstance(stale, dict) and stale.get("run_id") != self.run_id:
            warnings.warn(
                f"taking over the stale lock of checkpoint directory {str(self.directory)!r} left by "
                f"{_describe(stale)}, which ended without releasing it",
                RuntimeWarning,
                stacklevel=3,
            )
        holder = {
            "run_id": self.run_id,
            "plugin": self.plugin,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "since": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        }
        tmp = self.directory / f"{HOLDER}.{os.getpid()}"
        try:
            tmp.write_text(json.dumps(holder))
            os.replace(tmp, self.directory / HOLDER)
        except OSError:  # the details are for messages only; the OS lock is what counts
            tmp.unlink(missing_ok=True)

    def release(self) -> None:
        """Drop the lock (and the holder's details) if held."""
        if not self.held:
            return
        if (_read_holder(self.directory) or {}).get("run_id") == self.run_id:
            (self.directory / HOLDER).unlink(missing_ok=True)
        self._lock.release(force=True)
