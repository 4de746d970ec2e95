"""storage.write: one data file, concurrent fsyncs before the publishing rename, clear failures."""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from epochal_checkpoint import CheckpointWriteError, read_checkpoint
from epochal_checkpoint.storage import write
from epochal_checkpoint.storage.codec import flatten
from epochal_checkpoint.storage.layout import read_pointer
from epochal_checkpoint.storage.write import write_checkpoint


def save(directory: Path, state: dict[str, Any], name: str = "ckpt-e0000-i000001", sequence: int = 1) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    return write_checkpoint(directory, name, flatten(state), {"sequence": sequence, "run_id": "r"}).path


def test_a_save_writes_one_data_file_and_syncs_in_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    events: list[str] = []
    real_fsync, real_rename, real_replace = os.fsync, os.rename, os.replace

    def fsync(fd: int) -> None:
        events.append(
            "fsync " + os.path.basename(os.readlink(f"/proc/self/fd/{fd}")).split(".epochal-tmp-")[0]
        )
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", lambda a, b: (events.append("rename"), real_rename(a, b))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append("replace"), real_replace(a, b))[1])
    (tmp_path / "c").mkdir()
    path = save(tmp_path / "c", {"model": {"w": np.zeros(100)}})
    # the files and the temporary directory are fsynced together (concurrently: their order is
    # not fixed), all before the rename that publishes them
    assert sorted(events[:3]) == ["fsync ckpt-e0000-i000001", "fsync data.bin", "fsync manifest.json"]
    assert events[3:] == [
        "rename",
        "replace",  # latest: a link holding the name, durable with the directory sync below
        "fsync c",
    ]
    assert sorted(p.name for p in path.iterdir()) == ["data.bin", "manifest.json"]
    assert os.readlink(tmp_path / "c" / "latest") == path.name


def test_no_fsync_thread_outlives_a_save_into_a_fork(tmp_path: Path) -> None:
    """A forked child (a DataLoader worker) gets no idle fsync threads, and the parent saves
    again after the fork (Python 3.12+ warns about forking a process with threads)."""

    def fsync_threads() -> list[str]:
        return [t.name for t in threading.enumerate() if t.name.startswith("epochal-fsync")]

    save(tmp_path, {"w": np.zeros(10)}, "ckpt-e0000-i000001")
    assert fsync_threads()  # the save's fsyncs ran on the pool
    pid = os.fork()
    if pid == 0:  # the child: report whether any fsync thread exists here, then leave at once
        os._exit(0 if not fsync_threads() else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert fsync_threads() == []  # shut down in the parent before the fork
    path = save(tmp_path, {"w": np.ones(10)}, "ckpt-e0001-i000002")
    assert read_checkpoint(path)[0]["w"].tolist() == [1.0] * 10


def test_a_failed_fsync_of_one_file_is_one_clear_error_and_the_earlier_checkpoint_is_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The files are fsynced concurrently: one that fails (EIO on data.bin) fails the save after
    every other fsync ended, names the checkpoint, leaves no temporary directory, and keeps the
    earlier checkpoint and ``latest``."""
    earlier = save(tmp_path, {"w": np.zeros(10)}, "ckpt-e0000-i000001")
    real_fsync = os.fsync
    ended: list[str] = []

    def fsync(fd: int) -> None:
        name = os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))
        if name == "data.bin":
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        real_fsync(fd)
        ended.append(name.split(".epochal-tmp-")[0])

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(
        CheckpointWriteError, match=r"cannot write checkpoint .*ckpt-e0001-i000002.*Input/output error"
    ):
        write_checkpoint(tmp_path, "ckpt-e0001-i000002", flatten({"w": np.ones(10)}), {"sequence": 2})
    assert sorted(ended) == ["ckpt-e0001-i000002", "manifest.json"]  # the others ran to their end
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-e0000-i000001", "latest"]
    assert read_pointer(tmp_path) == earlier.name
    assert read_checkpoint(earlier)[0]["w"].tolist() == [0.0] * 10


def test_a_save_when_no_thread_pool_takes_work_fsyncs_in_the_calling_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At interpreter exit a thread pool refuses work: the fsyncs then run in the saving thread."""
    from concurrent.futures import ThreadPoolExecutor

    refusing = ThreadPoolExecutor(max_workers=1)
    refusing.shutdown()
    monkeypatch.setattr(write, "_sync_pool", refusing)
    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(threading.current_thread().name)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    path = save(tmp_path, {"w": np.ones(10)})
    assert read_checkpoint(path)[0]["w"].tolist() == [1.0] * 10
    assert synced and set(synced) == {threading.current_thread().name}
