"""A writing run in a subprocess: readers poll it concurrently; kill -9 leaves every committed flush."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

WRITER = """
import sys, time
from epochal import Loop
from epochal_sqlite import SQLiteLog
from epochal.testing import StubModel, TrainRecords

db, epochs, flush_every, pause = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])

def step(batch):
    time.sleep(pause)
    return {f"m{j}": batch[0] + j / 10 for j in range(10)}

loop = Loop(
    StubModel(train=step, evaluation={"loss": 0.5}),
    {"train": [[i] for i in range(50)]},
    plugins={
        "recorder": TrainRecords(),
        "sqlite_log": SQLiteLog(path=db, flush_every=flush_every, flush_seconds=0),
    },
    max_epochs=epochs,
)
print(loop.run_id, flush=True)
loop.run()
"""


EPOCHAL = [sys.executable, "-c", "from epochal.cli import main; main()"]


def env() -> dict[str, str]:
    return {**os.environ, "EPOCHAL_DISABLE_PLUGIN_AUTOLOAD": "1", "EPOCHAL_PLUGINS": "sqlite_log"}


def start_writer(
    tmp_path: Path, db: Path, epochs: int, flush_every: int, pause: float
) -> subprocess.Popen[str]:
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    args = [sys.executable, str(script), str(db), str(epochs), str(flush_every), str(pause)]
    return subprocess.Popen(
        args, cwd=tmp_path, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def count_iterations(db: Path, run_id: str = "%") -> int:
    """Distinct iterations committed so far (0 while the file or its tables do not exist yet)."""
    if not db.exists():
        return 0
    # A reader with sqlite3's default busy timeout (5 s), as a notebook would open it.
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        query = "SELECT count(DISTINCT iteration) FROM log WHERE run_id LIKE ?"
        return int(conn.execute(query, (run_id,)).fetchone()[0])
    except sqlite3.OperationalError as error:
        if "no such table" in str(error):
            return 0
        raise
    finally:
        conn.close()


def test_readers_poll_while_a_run_writes_without_lock_errors(tmp_path: Path) -> None:
    db = tmp_path / "log.sqlite"
    writer = start_writer(tmp_path, db, epochs=30, flush_every=5, pause=0.002)  # 1,500 batches
    counts: list[int] = []
    cli_statuses: list[str] = []
    errors: list[str] = []
    try:
        while writer.poll() is None:
            try:
                counts.append(count_iterations(db))
            except sqlite3.Error as error:
                errors.append(f"sqlite3: {error}")
            if len(counts) % 20 == 0 and counts[-1] > 0:
                listed = subprocess.run(
                    [*EPOCHAL, "log", "runs", "--db", str(db), "--json"],
                    env=env(), capture_output=True, text=True, timeout=60,
                )  # fmt: skip
                if listed.returncode != 0:
                    errors.append(f"epochal log runs: {listed.stderr.strip()}")
                else:
                    cli_statuses.extend(r["status"] for r in json.loads(listed.stdout))
    finally:
        if writer.poll() is None:
            writer.kill()
        _, stderr = writer.communicate(timeout=60)
    assert writer.returncode == 0, stderr
    assert errors == []
    assert counts == sorted(counts)  # readers only ever saw whole flushes appear
    assert any(0 < c < 1500 for c in counts)  # some reads happened while the run was writing
    assert cli_statuses and set(cli_statuses) <= {"running", "finished"}  # never misread as killed
    assert count_iterations(db) == 1500


def test_kill_9_keeps_every_committed_flush_and_the_run_is_marked_killed(tmp_path: Path) -> None:
    db = tmp_path / "log.sqlite"
    killed_ids = []
    for target in (30, 90, 200):  # three runs into the same file, killed at different points
        writer = start_writer(tmp_path, db, epochs=1000, flush_every=7, pause=0.001)
        assert writer.stdout is not None
        run_id = writer.stdout.readline().strip()
        try:
            seen = 0
            while seen < target:
                assert writer.poll() is None, writer.communicate()[1]
                seen = count_iterations(db, run_id)
                time.sleep(0.005)
        finally:
            os.kill(writer.pid, signal.SIGKILL)
            writer.communicate(timeout=60)
        assert writer.returncode == -signal.SIGKILL
        killed_ids.append((run_id, seen))

        conn = sqlite3.connect(db)
        assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        # The cursor is committed in the same transaction as the rows: rows 1..F are all there,
        # each with its 10 records, and nothing of a flush that did not commit.
        (flushed,) = conn.execute("SELECT flushed_iteration FROM runs WHERE run_id = ?", (run_id,)).fetchone()
        # each row's 10 train.* records (epochs_done comes every 50 rows)
        query = (
            "SELECT iteration, count(*) FROM log WHERE run_id = ? AND key LIKE 'train.%' GROUP BY iteration"
        )
        per_row = dict(conn.execute(query, (run_id,)))
        conn.close()
        assert flushed >= seen and sorted(per_row) == list(range(1, flushed + 1))
        assert set(per_row.values()) == {10}

    listed = subprocess.run(
        [*EPOCHAL, "log", "runs", "--db", str(db), "--json"],
        env=env(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert listed.returncode == 0, listed.stderr
    runs = {r["run_id"]: r for r in json.loads(listed.stdout)}
    for run_id, _ in killed_ids:
        assert runs[run_id]["status"] == "killed"
        assert runs[run_id]["ended"] is not None and "killed or crashed" in runs[run_id]["finish_reason"]
    assert not (tmp_path / "log.sqlite.locks").exists()  # stale locks were cleaned up
