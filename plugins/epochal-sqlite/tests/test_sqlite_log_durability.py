"""A new log database survives a power loss: its bytes and its name (and new directories) are fsynced."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from epochal_sqlite import store


def test_a_new_database_and_its_directories_are_fsynced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    synced: list[Path] = []
    real_dir = store._fsync_dir
    monkeypatch.setattr(store, "_fsync_dir", lambda path: (synced.append(Path(path)), real_dir(path))[1])
    files: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        files.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    db = tmp_path / "sub" / "dir" / "log.sqlite"
    store.connect(db, create=True).close()
    assert synced[:3] == [tmp_path, tmp_path / "sub", tmp_path / "sub" / "dir"], synced
    assert any(name.endswith(".new") for name in files), files  # the file, before it is linked
