"""The database file: schema version and migrations, refusing files that are not ours, killed runs."""

from __future__ import annotations

import shutil
import sqlite3
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from epochal_sqlite import SQLiteLog, store

from epochal import EpochalError, Loop


class TinyModel:
    def train_step(self, batch: Any) -> Mapping[str, Any]:
        return {}

    def eval_step(self, batch: Any) -> Mapping[str, Any]:
        return {"loss": 0.5}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        pass


def run_once(db: Path) -> str:
    loop = Loop(
        TinyModel(),
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


def schema_of(conn: sqlite3.Connection) -> dict[str, Any]:
    """Every table, view and index of *conn*: columns (types, defaults, keys), indexes, view SQL."""
    out: dict[str, Any] = {}
    for kind, name, sql in conn.execute("SELECT type, name, sql FROM sqlite_master ORDER BY name"):
        if kind == "index":
            out[name] = (kind, conn.execute(f"PRAGMA index_xinfo({name})").fetchall())
        else:
            columns = conn.execute(f"PRAGMA table_xinfo({name})").fetchall()
            indexes = [row[1:] for row in conn.execute(f"PRAGMA index_list({name})")]
            out[name] = (kind, columns, indexes, sql if kind == "view" else None)
    out["#meta"] = sorted(conn.execute("SELECT key FROM meta"))
    out["#pragmas"] = [conn.execute(f"PRAGMA {p}").fetchone() for p in ("user_version", "application_id")]
    return out


def test_a_new_file_has_the_schema_the_migration_steps_make_one_by_one(tmp_path: Path) -> None:
    """A new file's schema is made at once (cheaper); it must be what every step from an empty
    file makes, so that files made either way read and migrate alike."""
    run_once(tmp_path / "new.sqlite")
    stepped = sqlite3.connect(tmp_path / "stepped.sqlite", isolation_level=None)
    for target in range(1, store.SCHEMA_VERSION + 1):  # one version at a time: no shortcut
        store.migrate(stepped, tmp_path / "stepped.sqlite", target=target)
    new = sqlite3.connect(tmp_path / "new.sqlite")
    assert schema_of(new) == schema_of(stepped)
    assert "runs_num" in schema_of(new) and schema_of(new)["log"][0] == "view"


def test_a_new_file_also_takes_the_steps_after_the_one_step_schema(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hypothetical version 4 step runs on a new file too, after the schema made at once."""

    def add_note_column(conn: sqlite3.Connection) -> None:
        conn.execute("ALTER TABLE runs ADD COLUMN note TEXT DEFAULT 'v4'")

    monkeypatch.setattr(store, "MIGRATIONS", [*store.MIGRATIONS, add_note_column])
    run_id = run_once(tmp_path / "log.sqlite")
    conn = sqlite3.connect(tmp_path / "log.sqlite")
    assert conn.execute("PRAGMA user_version").fetchone()[0] == 4
    assert conn.execute("SELECT run_id, note FROM runs").fetchall() == [(run_id, "v4")]
    conn.close()


def test_migration_steps_upgrade_an_older_file_in_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hypothetical version 4 adds a column: a version-3 file with runs is upgraded on open."""
    db = tmp_path / "log.sqlite"
    run_id = run_once(db)

    def add_note_column(conn: sqlite3.Connection) -> None:
        conn.execute("ALTER TABLE runs ADD COLUMN note TEXT DEFAULT 'from v1'")

    monkeypatch.setattr(store, "MIGRATIONS", [*store.MIGRATIONS, add_note_column])
    conn = store.connect(db, create=False)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == 4
    assert conn.execute("SELECT run_id, note FROM runs").fetchall() == [(run_id, "from v1")]
    assert (
        conn.execute("SELECT count(*) FROM log WHERE run_id = ?", (run_id,)).fetchone()[0] == 4
    )  # 2 epochs x (epochs_done, valid.loss)
    conn.close()
    assert store.migrate(sqlite3.connect(db), db) == 4  # already current: nothing to do


def test_a_file_from_a_newer_version_is_a_clear_error_for_reader_and_writer(tmp_path: Path) -> None:
    db = tmp_path / "log.sqlite"
    run_once(db)
    conn = sqlite3.connect(db)
    conn.execute("PRAGMA user_version = 7")
    conn.close()
    with pytest.raises(
        store.SchemaVersionError, match=r"log schema version 7, newer .*upgrade epochal-sqlite"
    ):
        store.Reader(db)
    with pytest.raises(store.SchemaVersionError, match=r"log\.sqlite"):
        run_once(db)


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
        with store.Reader(db) as reader:
            status = {r.run_id: (r.status, r.ended) for r in reader.runs()}
        assert status["alive"] == ("running", None)
        assert status["gone"] == ("killed", 3.0)
        assert reader.get  # the reader closed cleanly
    finally:
        lock.release()
    with store.Reader(db) as reader:
        killed = reader.get("alive")
    assert (
        killed is not None
        and killed.status == "killed"
        and "killed or crashed" in (killed.finish_reason or "")
    )
    assert not (tmp_path / "log.sqlite.locks").exists()


def test_encode_decode_round_trip() -> None:
    for value in [0.5, -3, 2**60, True, None, "s", [1, "a"], {"k": [1.5]}, float("inf")]:
        assert store.decode(*store.encode(value)) == value
    assert store.encode(1.25) == (1.25, None) and store.encode(3) == (3.0, None)
    assert store.encode(float("nan")) == (None, "NaN")


V1_FILE = Path(__file__).parent / "data" / "v1.sqlite"


def test_a_version_1_file_written_by_epochal_sqlite_0_1_is_migrated_with_every_record(
    tmp_path: Path,
) -> None:
    """``data/v1.sqlite`` was written by the plugin of schema version 1 (two runs, text, NaN and
    superseded rows): opening it migrates it to integer-keyed records, nothing lost."""
    db = tmp_path / "old.sqlite"
    shutil.copyfile(V1_FILE, db)
    old = sqlite3.connect(db)
    assert old.execute("PRAGMA user_version").fetchone()[0] == 1
    columns = "run_id, iteration, key, value, value_json, superseded"
    before = sorted(old.execute(f"SELECT {columns} FROM log"), key=repr)
    runs = [r for (r,) in old.execute("SELECT run_id FROM runs ORDER BY started")]
    old.close()
    assert len(before) == 34 and any(row[5] for row in before)

    with store.Reader(db) as reader:
        assert reader.conn.execute("PRAGMA user_version").fetchone()[0] == 3
        after = sorted(reader.conn.execute(f"SELECT {columns} FROM log"), key=repr)  # the view
        assert after == before
        for run_id in runs:
            expected = [
                (i, k, store.decode(v, j)) for r, i, k, v, j, sup in before if r == run_id and not sup
            ]
            got = list(reader.records(run_id))
            assert sorted(got, key=repr) == sorted(expected, key=repr)
            assert [i for i, _, _ in got] == sorted(i for i, _, _ in got)
            one = list(reader.records(run_id, keys=["note"]))
            assert one and {k for _, k, _ in one} == {"note"}
        assert reader.keys(runs) == sorted({row[2] for row in before})
    # and a new run goes on writing into the migrated file
    run_once(db)
    with store.Reader(db) as reader:
        assert len(reader.runs()) == 3


V2_FILE = Path(__file__).parent / "data" / "v2.sqlite"


def test_a_version_2_file_written_by_the_schema_2_plugin_is_migrated_with_every_record(
    tmp_path: Path,
) -> None:
    """``data/v2.sqlite`` was written by the plugin of schema version 2 (``data/make_v2.py``: a run
    and a run resumed from it, floats, ints, big ints, booleans, text, lists, NaN, -inf,
    superseded rows): opening it packs the records into chunks, nothing lost, the same rows read."""
    db = tmp_path / "old.sqlite"
    shutil.copyfile(V2_FILE, db)
    old = sqlite3.connect(db)
    assert old.execute("PRAGMA user_version").fetchone()[0] == 2
    columns = "run_id, iteration, key, value, value_json, superseded"
    before = old.execute(f"SELECT {columns} FROM log").fetchall()
    runs = [r for (r,) in old.execute("SELECT run_id FROM runs ORDER BY started")]
    old.close()
    assert len(before) == 132 and sum(row[5] for row in before) == 44
    decoded = {(r, i, k, sup): store.decode(v, j) for r, i, k, v, j, sup in before}

    with store.Reader(db) as reader:
        assert reader.conn.execute("PRAGMA user_version").fetchone()[0] == 3
        tables = {name for (name,) in reader.conn.execute("SELECT name FROM sqlite_master")}
        assert "records" not in tables and {"chunks", "log"} <= tables
        # the view: every record once, same values (-inf now as JSON text), same superseded flags
        after = reader.conn.execute(f"SELECT {columns} FROM log").fetchall()
        assert len(after) == len(before)
        assert {(r, i, k, sup): store.decode(v, j) for r, i, k, v, j, sup in after}.keys() == decoded.keys()
        for r, i, k, v, j, sup in after:
            expected = decoded[(r, i, k, sup)]
            got = store.decode(v, j)
            assert got == expected or (got != got and expected != expected), (r, i, k)
            assert type(got) is type(expected)
        for run_id in runs:
            for with_superseded in (False, True):
                expected_records = sorted(
                    (i, k, value)
                    for (r, i, k, sup), value in decoded.items()
                    if r == run_id and (with_superseded or not sup) and k != "nan"
                )
                got_records = [
                    rec for rec in reader.records(run_id, superseded=with_superseded) if rec[1] != "nan"
                ]
                assert got_records == expected_records
            one = list(reader.records(run_id, keys=["big"]))
            assert one and all(k == "big" and v == 2**60 + i for i, k, v in one)
        first, second = (reader.get(r) for r in runs)
        assert first is not None and second is not None and second.resumed_from == first.run_id
        timeline = reader.timeline(second, ["train.loss"])
        assert [i for i, _, _ in timeline] == list(range(1, 13))
        assert [owner for _, owner, _ in timeline] == [first.run_id] * 3 + [second.run_id] * 9
        assert reader.keys(runs) == sorted({row[2] for row in before})
    # and a new run goes on writing into the migrated file
    run_once(db)
    with store.Reader(db) as reader:
        assert len(reader.runs()) == 3
