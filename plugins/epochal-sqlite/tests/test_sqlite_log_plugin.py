"""The sqlite_log plugin in real loops (Python API): what it writes, when, and on resume/failure."""

from __future__ import annotations

import copy
import math
import sqlite3
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from epochal_sqlite import Reader, SQLiteLog

from epochal import Loop, PluginError, hookimpl, load_plugins
from epochal.testing import TrainRecords


class CountingModel:
    """A model whose train_step returns ``k`` metrics derived from a step counter."""

    def __init__(self, k: int = 3, fail_at: int | None = None) -> None:
        self.k, self.step, self.fail_at = k, 0, fail_at

    def train_step(self, batch: Any) -> Mapping[str, Any]:
        self.step += 1
        if self.fail_at is not None and self.step == self.fail_at:
            raise RuntimeError(f"boom at step {self.step}")
        return {f"m{j}": self.step + j / 10 for j in range(self.k)}

    def eval_step(self, batch: Any) -> Mapping[str, Any]:
        return {"loss": 1.0 / (1 + self.step)}

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.step = int(state["step"])


def data(batches: int = 5, valid: bool = True) -> dict[str, Any]:
    streams: dict[str, Any] = {"train": [[i] for i in range(batches)]}
    if valid:
        streams["valid"] = [[0], [1]]
    return streams


def rows_of(db: Path, run_id: str) -> dict[int, dict[str, Any]]:
    with Reader(db) as reader:
        run = reader.get(run_id)
        assert run is not None
        return {i: record for i, _, record in reader.timeline(run, chain=False)}


def test_every_record_of_every_row_is_written_with_status_and_config(tmp_path: Path) -> None:
    db = tmp_path / "log.sqlite"
    plugin = SQLiteLog(path=str(db), flush_every=3)
    loop = Loop(
        CountingModel(),
        data(),
        plugins={"recorder": TrainRecords(), "sqlite_log": plugin},
        max_epochs=2,
        config={"loop": {"max_epochs": 2}, "model": {"factory": "x:y"}},
        handle_signals=False,
    )
    log = loop.run()
    expected = {i: dict(row) for i, row in log.rows()}
    assert rows_of(db, loop.run_id) == expected
    assert expected[5]["valid.loss"] == pytest.approx(1 / 6) and expected[10]["epochs_done"] == 2
    with Reader(db) as reader:
        (run,) = reader.runs()
    assert run.run_id == loop.run_id
    assert (run.status, run.finish_reason, run.epochs_done, run.iterations_done) == (
        "finished",
        "max_epochs=2 reached",
        2,
        10,
    )
    assert run.ended is not None and run.ended >= run.started
    assert run.config == {"loop": {"max_epochs": 2}, "model": {"factory": "x:y"}}
    assert list(run.plugins) == ["recorder", "sqlite_log"]
    assert run.log_status["status"] == "finished" and run.resumed_from is None
    assert plugin.records_written == sum(len(r) for r in expected.values())
    assert not (tmp_path / "log.sqlite.locks").exists()  # the run's lock is gone


def test_default_path_is_beside_the_run_dir_and_many_runs_share_the_file(tmp_path: Path) -> None:
    ids = []
    for _ in range(3):
        loop = Loop(
            CountingModel(),
            data(),
            plugins={"sqlite_log": SQLiteLog()},
            max_epochs=1,
            run_dir=tmp_path / "runs" / "exp",
            handle_signals=False,
        )
        loop.run()
        ids.append(loop.run_id)
    assert not (tmp_path / "runs" / "exp" / "epochal.sqlite").exists()
    with Reader(tmp_path / "runs" / "epochal.sqlite") as reader:
        assert [r.run_id for r in reader.runs()] == ids
        assert reader.resolve("latest").run_id == ids[-1]
        assert reader.resolve(ids[1][:10]).run_id == ids[1]


def test_records_written_later_into_the_current_row_are_picked_up(tmp_path: Path) -> None:
    """Eval records at epoch end, records of plugins running after us, after_training records."""

    class Late:
        @hookimpl
        def after_batch(self, loop: Any) -> None:
            loop.log.current_row["late.batch"] = loop.iteration

        @hookimpl
        def after_epoch(self, loop: Any) -> None:
            loop.log.current_row["late.epoch"] = loop.epoch

        @hookimpl
        def after_training(self, loop: Any) -> None:
            loop.log.current_row["late.final"] = "done"

    db = tmp_path / "log.sqlite"
    late = Late()
    # Late runs before sqlite_log in after_training (its record is flushed), after it per batch.
    loop = Loop(
        CountingModel(),
        data(4),
        plugins={"late": late, "sqlite_log": SQLiteLog(path=str(db), flush_every=1)},
        max_epochs=2,
        handle_signals=False,
    )
    log = loop.run()
    rows = rows_of(db, loop.run_id)
    assert rows == {i: dict(row) for i, row in log.rows()}
    assert rows[8]["late.final"] == "done" and rows[8]["late.epoch"] == 2 and rows[4]["late.batch"] == 4


def test_a_record_assigned_again_after_a_flush_reads_back_as_its_last_value(tmp_path: Path) -> None:
    """The row being written is flushed, then a plugin assigns one of its records again (a new
    value, another kind of value): readers and the ``log`` view see the last value, once."""

    class Reassign:
        @hookimpl
        def after_batch(self, loop: Any) -> None:
            row = loop.log.current_row
            row["m"] = float(loop.iteration)

        @hookimpl
        def after_epoch(self, loop: Any) -> None:
            loop.log.current_row["m"] = "final" if loop.epoch == 1 else -1.5

    db = tmp_path / "log.sqlite"
    loop = Loop(
        CountingModel(),
        data(3, valid=False),
        # flush_every=1: each batch row is written before after_epoch assigns "m" again
        plugins={"sqlite_log": SQLiteLog(path=str(db), flush_every=1), "reassign": Reassign()},
        max_epochs=2,
        handle_signals=False,
    )
    log = loop.run()
    assert log[3]["m"] == "final" and log[6]["m"] == -1.5
    rows = rows_of(db, loop.run_id)
    assert {i: r["m"] for i, r in rows.items()} == {1: 1.0, 2: 2.0, 3: "final", 4: 4.0, 5: 5.0, 6: -1.5}
    with Reader(db) as reader:
        assert list(reader.records(loop.run_id, keys=["m"], upto=3))[-1] == (3, "m", "final")
    conn = sqlite3.connect(db)
    written = conn.execute(
        "SELECT count(*) FROM chunks WHERE key = (SELECT id FROM keys WHERE name = 'm') "
        "AND first <= 3 AND last >= 3"
    )
    assert written.fetchone()[0] == 2  # iteration 3 was written twice: the later wins
    view = conn.execute("SELECT iteration, value, value_json FROM log WHERE key = 'm' ORDER BY iteration")
    assert view.fetchall() == [
        (1, 1.0, None),
        (2, 2.0, None),
        (3, None, '"final"'),
        (4, 4.0, None),
        (5, 5.0, None),
        (6, -1.5, None),
    ]
    conn.close()


def test_values_names_and_keys_filter(tmp_path: Path) -> None:
    """Numbers as REAL, other JSON-able values as JSON; SQL-shaped names stored verbatim."""
    import numpy as np

    evil = "x'); DROP TABLE log; --"
    quoted = 'y" OR 1=1; DELETE FROM runs; --'
    values: dict[str, Any] = {
        evil: 1.5,
        quoted: 2,
        "nan": float("nan"),
        "inf": float("inf"),
        "np.float32": np.float32(0.25),
        "np.int64": np.int64(7),
        "flag": True,
        "text": "hello",
        "list": [1, 2.5, "a"],
        "dict": {"a": 1},
        "array": np.arange(3),
        "huge": 2**70,
        "none": None,
    }

    class Writer:
        @hookimpl
        def after_batch(self, loop: Any) -> None:
            loop.log.current_row.update(values)

    db = tmp_path / "log.sqlite"
    loop = Loop(
        CountingModel(),
        data(2, valid=False),
        plugins={"writer": Writer(), "sqlite_log": SQLiteLog(path=str(db))},
        max_epochs=1,
        handle_signals=False,
    )
    loop.run()
    stored = rows_of(db, loop.run_id)[2]
    assert stored[evil] == 1.5 and stored[quoted] == 2.0
    assert math.isnan(stored["nan"]) and stored["inf"] == math.inf
    assert stored["np.float32"] == 0.25 and stored["np.int64"] == 7.0
    assert stored["flag"] is True and stored["text"] == "hello" and stored["none"] is None
    assert stored["list"] == [1, 2.5, "a"] and stored["dict"] == {"a": 1} and stored["array"] == [0, 1, 2]
    assert stored["huge"] == 2**70
    conn = sqlite3.connect(db)
    objects = set(conn.execute("SELECT type, name FROM sqlite_master"))
    assert {("table", t) for t in ("runs", "keys", "chunks", "meta")} | {("view", "log")} <= objects
    (kind,) = conn.execute("SELECT typeof(value) FROM log WHERE key = ?", (evil,)).fetchone()
    assert kind == "real"
    assert conn.execute("SELECT value_json FROM log WHERE key = 'text'").fetchone() == ('"hello"',)
    conn.close()

    # keys: an allow-list of glob patterns
    db2 = tmp_path / "filtered.sqlite"
    loop = Loop(
        CountingModel(),
        data(2, valid=True),
        plugins={
            "recorder": TrainRecords(),
            "sqlite_log": SQLiteLog(path=str(db2), keys=["valid.*", "train.m1"]),
        },
        max_epochs=1,
        handle_signals=False,
    )
    loop.run()
    keys = {key for row in rows_of(db2, loop.run_id).values() for key in row}
    assert keys == {"valid.loss", "train.m1"}


def test_flushes_by_rows_and_at_epoch_end(tmp_path: Path) -> None:
    db = tmp_path / "log.sqlite"
    seen: list[int] = []

    class Probe:
        """Counts the rows committed so far, through a second connection, after every batch."""

        @hookimpl
        def after_batch(self, loop: Any) -> None:
            conn = sqlite3.connect(db)
            seen.append(conn.execute("SELECT count(DISTINCT iteration) FROM log").fetchone()[0])
            conn.close()

    loop = Loop(
        CountingModel(),
        data(7, valid=False),
        plugins={
            "recorder": TrainRecords(),
            "sqlite_log": SQLiteLog(path=str(db), flush_every=3, flush_seconds=0),
            "probe": Probe(),
        },
        max_epochs=2,
        handle_signals=False,
    )
    loop.run()
    # The probe runs after sqlite_log: a flush happens when 3 rows are buffered (after batches
    # 3 and 6, writing rows up to the current one) and at the end of epoch 1 (iteration 7).
    assert seen[:7] == [0, 0, 3, 3, 3, 6, 6]
    assert seen[7] == 7  # epoch 1's rows were all flushed at its end
    assert rows_of(db, loop.run_id)[14]["train.m0"] == 14


@pytest.mark.parametrize("every", [10**6, 0])  # 0: never by count
@pytest.mark.parametrize("seconds", [0.0, 0.01])
def test_flushes_by_time_only_when_flush_seconds_is_set(tmp_path: Path, seconds: float, every: int) -> None:
    import time

    class Slow(CountingModel):
        def train_step(self, batch: Any) -> Mapping[str, Any]:
            time.sleep(0.006)  # two batches are more than 0.01 s
            return super().train_step(batch)

    log = SQLiteLog(path=str(tmp_path / "log.sqlite"), flush_every=every, flush_seconds=seconds)
    # with neither a count nor a time, after_batch has nothing to do: the loop need not call it
    assert log.idle_hooks == (set() if every or seconds else {"after_batch"})
    flushed: list[int] = []
    flush = log.flush

    def counting(loop: Any, *args: Any, **kwargs: Any) -> int:
        flushed.append(loop.iteration)
        return flush(loop, *args, **kwargs)

    log.flush = counting  # type: ignore[method-assign]
    plugins = {"recorder": TrainRecords(), "sqlite_log": log}
    loop = Loop(Slow(), data(8, valid=False), plugins=plugins, max_epochs=1)
    loop.run()
    by_time = [i for i in flushed if i < 8]
    if seconds:
        assert by_time and all(b - a <= 2 for a, b in zip([0, *by_time], by_time))
    else:
        assert by_time == [] and flushed == [8, 8]  # the epoch's end, the end of training
    assert rows_of(tmp_path / "log.sqlite", loop.run_id)[8]["train.m0"] == 8


def test_a_negative_flush_every_is_one_clear_error() -> None:
    with pytest.raises(PluginError, match=r"'flush_every' of plugin 'sqlite_log' must be greater than or"):
        load_plugins(order=["sqlite_log"], autoload=False, options={"sqlite_log": {"flush_every": -1}})


def test_failed_run_is_recorded_with_its_error_and_rows(tmp_path: Path) -> None:
    db = tmp_path / "log.sqlite"
    loop = Loop(
        CountingModel(fail_at=9),
        data(5),
        plugins={"recorder": TrainRecords(), "sqlite_log": SQLiteLog(path=str(db), flush_every=100)},
        max_epochs=3,
        handle_signals=False,
    )
    with pytest.raises(RuntimeError, match="boom"):
        loop.run()
    with Reader(db) as reader:
        run = reader.resolve("latest")
    assert run.status == "failed" and run.error == "RuntimeError: boom at step 9"
    assert run.error_plugin is None and run.iterations_done == 8
    assert sorted(rows_of(db, loop.run_id)) == list(range(1, 9))


def test_a_flush_that_fails_loses_no_record_and_no_new_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A flush fails inside its transaction, after the keys it saw first were added: the
    rollback takes those keys back, and the next flush (the failed run's last) writes its
    records again, every one under its own key."""
    from epochal_sqlite import store

    class Extra:
        @hookimpl
        def after_batch(self, loop: Any) -> None:
            if loop.iteration >= 3:
                loop.log.current_row["extra.x"] = loop.iteration * 10
                loop.log.current_row[f"extra.only{loop.iteration}"] = -loop.iteration

    real_chunk = store.chunk
    failed: list[int] = []

    def chunk(run: int, key: int, steps: list[int], values: list[Any], kind: int) -> tuple[Any, ...]:
        if 3 in steps and not failed:
            failed.append(key)
            raise sqlite3.OperationalError("disk I/O error")
        return real_chunk(run, key, steps, values, kind)

    monkeypatch.setattr(store, "chunk", chunk)
    db = tmp_path / "log.sqlite"
    loop = Loop(
        CountingModel(),
        data(5, valid=False),
        plugins={
            "recorder": TrainRecords(),
            "extra": Extra(),
            "sqlite_log": SQLiteLog(path=str(db), flush_every=1),
        },
        max_epochs=1,
        handle_signals=False,
    )
    failure = r"log\.sqlite: .*\(disk I/O error\); .*up to iteration 2"  # one line: file, error, kept
    with pytest.raises(store.DatabaseAccessError, match=failure):
        loop.run()
    assert failed
    rows = rows_of(db, loop.run_id)
    assert rows == {i: dict(row) for i, row in loop.log.rows()}
    assert rows[3]["extra.x"] == 30 and rows[3]["extra.only3"] == -3 and "extra.x" not in rows[2]
    with Reader(db) as reader:
        run = reader.resolve("latest")
        assert run.status == "failed" and "disk I/O error" in (run.error or "")
    conn = sqlite3.connect(db)
    names = [name for (name,) in conn.execute("SELECT name FROM keys ORDER BY id")]
    conn.close()
    assert len(names) == len(set(names)) and {"extra.x", "extra.only3"} <= set(names)


def test_resumed_run_is_a_new_run_and_the_chain_is_one_timeline(tmp_path: Path) -> None:
    """Run A saves its state at epoch 2 and goes on to epoch 3; run B resumes from epoch 2."""
    db = tmp_path / "log.sqlite"
    saved: dict[str, Any] = {}

    class Saver:
        @hookimpl
        def after_epoch(self, loop: Any) -> None:
            if loop.epoch == 2:
                saved.update(copy.deepcopy(loop.state_dict()))

    class Resumer:
        @hookimpl
        def resume_state(self, loop: Any) -> Any:
            return saved

    first = Loop(
        CountingModel(),
        data(5),
        plugins={
            "recorder": TrainRecords(),
            "saver": Saver(),
            "sqlite_log": SQLiteLog(path=str(db), flush_every=2),
        },
        max_epochs=3,
        handle_signals=False,
    )
    first.run()
    second = Loop(
        CountingModel(),
        data(5),
        plugins={"recorder": TrainRecords(), "resumer": Resumer(), "sqlite_log": SQLiteLog(path=str(db))},
        max_epochs=4,
        handle_signals=False,
    )
    second.run()
    assert second.resumed_from == first.run_id
    with Reader(db) as reader:
        run = reader.resolve("latest")
        assert run.run_id == second.run_id and run.resumed_from == first.run_id
        assert run.start_iteration == 10
        assert [r.run_id for r in reader.chain(run)] == [first.run_id, second.run_id]
        timeline = reader.timeline(run)
        alone = reader.timeline(run, chain=False)
    owners = {i: owner for i, owner, _ in timeline}
    assert [i for i, _, _ in timeline] == list(range(1, 21))
    assert all(owners[i] == first.run_id for i in range(1, 11))
    assert all(owners[i] == second.run_id for i in range(11, 21))
    epochs = [record["epochs_done"] for _, _, record in timeline if "epochs_done" in record]
    assert epochs == [1, 2, 3, 4]  # run A's epoch 3 (superseded by B's) is not in the timeline
    assert [i for i, _, _ in alone] == list(range(11, 21))  # the restored row 10 is not re-written
    with Reader(db) as reader:
        # the rows run A wrote after iteration 10 are marked superseded: the model never saw them
        marked = reader.conn.execute(
            "SELECT DISTINCT iteration FROM log WHERE run_id = ? AND superseded = 1 ORDER BY iteration",
            (first.run_id,),
        ).fetchall()
        first_alone = reader.timeline(reader.resolve(first.run_id), chain=False)
        everything = reader.timeline(reader.resolve(first.run_id), chain=False, superseded=True)
    assert [i for (i,) in marked] == list(range(11, 16))
    assert [i for i, _, _ in first_alone] == list(range(1, 11))
    assert [i for i, _, _ in everything] == list(range(1, 16))


def test_a_full_log_stops_the_run_with_one_error_and_keeps_every_committed_flush(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SQLite's own SQLITE_FULL (here from ``PRAGMA max_page_count``; a real full disk in
    test_sqlite_log_faults.py): SQLite rolls the transaction back itself, so the plugin must not
    (that raised "cannot rollback - no transaction is active" over the real error). One error,
    no warning; every flush committed before it is in the file, and nothing after it."""
    import warnings

    from epochal_sqlite import store

    real_connect = store.connect

    def connect(path: str | Path, *, create: bool) -> sqlite3.Connection:
        conn = real_connect(path, create=create)
        (pages,) = conn.execute("PRAGMA page_count").fetchone()
        conn.execute(f"PRAGMA max_page_count = {pages + 3}")  # a few flushes' worth
        return conn

    monkeypatch.setattr(store, "connect", connect)
    db = tmp_path / "log.sqlite"
    loop = Loop(
        CountingModel(k=20),
        data(200, valid=False),
        plugins={"recorder": TrainRecords(), "sqlite_log": SQLiteLog(path=str(db), flush_every=1)},
        max_epochs=1,
        handle_signals=False,
    )
    with warnings.catch_warnings(record=True) as caught, pytest.raises(store.DatabaseAccessError) as raised:
        warnings.simplefilter("always")
        loop.run()
    message = str(raised.value).splitlines()[0]
    assert message.startswith(
        f"cannot write the training log {db}: the disk is full (database or disk is full)"
    )
    kept = int(message.rsplit("up to iteration ", 1)[1])
    assert 0 < kept < loop.iteration
    assert not [w for w in caught if "sqlite_log" in str(w.message)]
    rows = rows_of(db, loop.run_id)
    assert rows == {i: dict(row) for i, row in loop.log.rows() if i <= kept}
    with Reader(db) as reader:
        run = reader.get(loop.run_id)
        assert run is not None and run.status == "killed" and run.iterations_done == kept
    conn = sqlite3.connect(db)
    assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    conn.close()


def test_the_plot_hint_keeps_its_key_when_nothing_is_left_to_train(tmp_path: Path) -> None:
    """Issue 47: a resume with nothing left to train evaluates nothing, and the summary's plot
    command switched from ``valid.loss`` to ``train.loss``."""
    from epochal.testing import ResumeFrom, run_loop

    db = str(tmp_path / "log.sqlite")
    first_log = SQLiteLog(path=db)
    first = run_loop({"train": TrainRecords(), "sqlite_log": first_log}, max_epochs=2)
    again_log = SQLiteLog(path=db)
    resume = ResumeFrom(first.loop.state_dict())
    again = run_loop({"resume": resume, "train": TrainRecords(), "sqlite_log": again_log}, max_epochs=2)
    assert again.loop.iteration == first.loop.iteration  # nothing trained, nothing evaluated
    for log, result in ((first_log, first), (again_log, again)):
        (plot,) = [line for line in log.run_summary(result.loop) if line.startswith("plot: ")]
        assert "--key valid.loss -o valid-loss.png" in plot, plot
