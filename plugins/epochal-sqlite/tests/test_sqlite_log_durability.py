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


def test_a_new_database_appears_whole_in_wal_mode_and_leaves_no_temporary_files(tmp_path: Path) -> None:
    db = tmp_path / "log.sqlite"
    store._create_file(db)
    header = db.read_bytes()[:100]
    assert header.startswith(b"SQLite format 3\x00")
    assert header[18:20] == b"\x02\x02"  # write and read versions 2: WAL mode, kept in the file
    assert sorted(p.name for p in tmp_path.iterdir()) == ["log.sqlite"]  # no .new, -wal or -shm
    conn = store.connect(db, create=False)
    try:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == store.SCHEMA_VERSION
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    finally:
        conn.close()
