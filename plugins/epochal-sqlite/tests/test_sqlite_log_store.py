"""The database file: its schema version, refusing files that are not ours, killed runs."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from epochal_sqlite import Reader, SQLiteLog, store

from epochal import EpochalError, Loop
from epochal.testing import StubModel


def run_once(db: Path) -> str:
    loop = Loop(
        StubModel(train={}, evaluation={"loss": 0.5}),
        {"train": [[1], [2]], "valid": [[1]]},
        plugins={"sqlite_log": SQLiteLog(path=str(db))},
        max_epochs=2,
        handle_signals=False,
    )
    loop.run()
    return loop.run_id


def test_new_file_has_current_schema_wal_and_our_application_id(tmp_path: Path) -> None:
    db = tmp_path / "sub" / "dir" / "log.sqlite"
    run_once(db)
    conn = sqlite3.connect(db)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == store.SCHEMA_VERSION == 3
    assert conn.execute("PRAGMA application_id").fetchone()[0] == store.APPLICATION_ID
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    columns = [row[1] for row in conn.execute("PRAGMA table_info(log)")]
    assert columns == ["run_id", "iteration", "key", "value", "value_json", "superseded"]
    assert conn.execute("SELECT DISTINCT superseded FROM log").fetchall() == [(0,)]
    assert dict(conn.execute("SELECT key, value FROM meta"))["schema_version"] == "3"
    chunks = [row[1] for row in conn.execute("PRAGMA table_info(chunks)")]
    assert chunks == ["run", "key", "first", "last", "steps", "vals", "kind", "superseded"]
    conn.close()


@pytest.mark.parametrize("version", [1, 2, 4, 7])
def test_a_file_of_another_schema_version_is_a_clear_error_for_reader_and_writer(
    tmp_path: Path, version: int
) -> None:
    """Only the current schema is read: an older file (versions 1 and 2 were never released, and
    there is no migration) or a newer one is refused, naming the file, the version found and the
    one expected, and left as it was."""
    db = tmp_path / "log.sqlite"
    run_once(db)
    conn = sqlite3.connect(db)
    conn.execute(f"PRAGMA user_version = {version}")
    conn.close()
    before = db.read_bytes()
    expected = rf"log\.sqlite has log schema version {version}, .*the version {store.SCHEMA_VERSION} "
    hint = "upgrade epochal-sqlite" if version > store.SCHEMA_VERSION else "start a new log file"
    with pytest.raises(store.SchemaVersionError, match=expected + ".*" + hint):
        Reader(db)
    with pytest.raises(store.SchemaVersionError, match=expected):
        run_once(db)
    assert db.read_bytes() == before


def test_writer_refuses_a_foreign_sqlite_file_and_leaves_it_alone(tmp_path: Path) -> None:
    db = tmp_path / "app.db"
    conn = sqlite3.connect(db)
    conn.execute("CREATE TABLE users (name TEXT)")
    conn.execute("INSERT INTO users VALUES ('ada')")
    conn.commit()
    conn.close()
    before = db.read_bytes()
    with pytest.raises(
        store.ForeignDatabaseError, match=r"app.db is a SQLite database but not an epochal-sqlite"
    ):
        run_once(db)
    assert db.read_bytes() == before
    text = tmp_path / "notes.txt"
    text.write_text("hello, not a database" * 100)
    with pytest.raises(store.NotADatabaseError, match=r"notes\.txt is not a SQLite database"):
        run_once(text)
    assert issubclass(store.SQLiteLogError, EpochalError)


def test_a_running_run_without_a_live_writer_is_marked_killed(tmp_path: Path) -> None:
    db = tmp_path / "log.sqlite"
    run_once(db)
    conn = store.connect(db, create=False)
    conn.execute(
        "INSERT INTO runs (run_id, started, updated, status) VALUES ('alive', 1.0, 2.0, 'running'), "
        "('gone', 1.0, 3.0, 'running')"
    )
    conn.close()
    lock = store.RunLock(db, "alive")
    lock.acquire()  # this process is the live writer of 'alive'
    try:
        with Reader(db) as reader:
            status = {r.run_id: (r.status, r.ended) for r in reader.runs()}
        assert status["alive"] == ("running", None)
        assert status["gone"] == ("killed", 3.0)
        assert reader.get  # the reader closed cleanly
    finally:
        lock.release()
    with Reader(db) as reader:
        killed = reader.get("alive")
    assert (
        killed is not None
        and killed.status == "killed"
        and "killed or crashed" in (killed.finish_reason or "")
    )
    assert not (tmp_path / "log.sqlite.locks").exists()


def test_a_reader_writes_nothing_and_leaves_no_wal_files(tmp_path: Path) -> None:
    """Readers open the file read-only: its bytes stay as they were, and the ``-wal``/``-shm``
    files a read-only connection leaves behind are removed when the reader closes."""
    db = tmp_path / "log.sqlite"
    run_id = run_once(db)
    before = db.read_bytes()
    with Reader(db) as reader:
        assert [run.run_id for run in reader.runs()] == [run_id]
        assert len(list(reader.records(run_id))) == 4
        with pytest.raises(sqlite3.OperationalError, match="readonly"):
            reader.conn.execute("DELETE FROM runs")
    assert db.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["log.sqlite"]


def test_encode_decode_round_trip() -> None:
    for value in [0.5, -3, 2**60, True, None, "s", [1, "a"], {"k": [1.5]}, float("inf")]:
        assert store.decode(*store.encode(value)) == value
    assert store.encode(1.25) == (1.25, None) and store.encode(3) == (3.0, None)
    assert store.encode(float("nan")) == (None, "NaN")
