"""Benchmark of the sqlite_log plugin (epochal-sqlite): write path, file size, reads, per-batch cost.

1. Write path, rows/s (a row = one record: run, iteration, key, value): the plugin turning a
   TrainingLog of 20,000 iterations x 10 metrics into committed rows, against the issue's floor
   — raw ``sqlite3`` ``executemany`` of ready-made tuples into a plain table ``(run INTEGER,
   step INTEGER, key TEXT, value REAL)`` (no key, no index; WAL, synchronous=NORMAL). Both in
   one transaction (the log keeps every row in memory, as the floor has its tuples ready;
   target ≥ 0.8×), and both committing every 1,000 iterations (the plugin's default
   ``flush_every``, the log with its default window). Then the bytes per numeric row of the
   plugin's file (target ≤ 30). Values have as many digits as real metrics (float32 reads).
2. Reading one key of a 1e6-row run (100,000 iterations x 10 keys, written in flushes of 1,000):
   ``Reader.timeline(run, [key])`` and ``plot.read_series`` in process, and ``epochal log show
   RUN --keys KEY --csv`` and ``epochal log plot RUN --key KEY -o x.png`` as subprocesses beside
   ``python -c pass`` and ``python -c "import matplotlib.pyplot"`` (target ≤ 0.3 s).
3. Per-batch overhead: a no-op loop (train_step returns 10 ready metrics, a plugin copies them
   into the log row) with and without sqlite_log (default options), and the cost of one
   ``after_batch`` call when no flush is due.
4. Opening a run's log: ``store.connect(path, create=True)`` and ``close()`` on a new file (the
   schema made, the file and its name fsynced) and on an existing one, beside the peers' log of
   ``bench/peers.py`` (``SQLiteSink``: ``sqlite3.connect``, WAL, one ``CREATE TABLE``, close).

Medians of alternating repeats, measured side by side in one run. Usage:
``python bench/sqlite_log.py [--quick]``.
"""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
import sqlite3
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
from _common import NoOpModel
from epochal_sqlite import SQLiteLog, store

from epochal import Loop, TrainingLog, hookimpl

KEYS = [f"train.metric{j}" for j in range(10)]
#: what the no-op model's train step returns: the keys without their "train." prefix.
OUTPUTS = {key[len("train.") :]: 0.5 for key in KEYS}
PLAIN = "INSERT INTO plain (run, step, key, value) VALUES (?, ?, ?, ?)"


def value(i: int, j: int) -> float:
    """A metric value with as many digits as a real one (a loss read from a float32 tensor
    prints as 17–18 characters), not a short decimal: the bytes per row depend on it."""
    return float(np.float32(1.0 / (1.0 + i * 1e-3) + j))


class FakeLoop:
    """What the plugin reads from a loop, around a filled TrainingLog."""

    def __init__(self, iterations: int, window: int | None = None) -> None:
        self.iteration = 0
        self.log = TrainingLog(lambda: self.iteration, window=window)
        for i in range(1, iterations + 1):
            row = self.log[i]
            for j, key in enumerate(KEYS):
                row[key] = value(i, j)
        self.log.status["status"] = "running"
        self.epoch, self.run_id, self.resumed_from, self.config = 0, uuid.uuid4().hex, None, {}
        self.run_dir, self.plugins, self.error_plugin = None, {}, None
        self.config_file = None  # the plugin records the file a run's configuration came from
        self.plugin_set = SimpleNamespace(infos=[])


def fresh_db(folder: Path, name: str) -> Path:
    path = folder / name
    for suffix in ("", "-wal", "-shm"):
        Path(str(path) + suffix).unlink(missing_ok=True)
    return path


def plugin_write(folder: Path, iterations: int, chunk: int) -> float:
    """Seconds for the plugin to write *iterations* rows, flushing every *chunk* iterations.

    The log keeps every row in memory (no window) when one flush writes them all, as the raw
    floor has every tuple ready in memory; else the log has its default window.
    """
    loop = FakeLoop(iterations, window=0 if chunk >= iterations else None)
    plugin = SQLiteLog(path=str(fresh_db(folder, "plugin.sqlite")), flush_seconds=0)
    plugin.before_training(loop)  # type: ignore[arg-type]
    start = time.perf_counter()
    for end in range(chunk, iterations + chunk, chunk):
        loop.iteration = min(end, iterations)
        plugin.flush(loop)  # type: ignore[arg-type]
    elapsed = time.perf_counter() - start
    assert plugin.records_written == iterations * len(KEYS), plugin.records_written
    plugin.close()
    return elapsed


def raw_write(folder: Path, iterations: int, chunk: int) -> float:
    """Seconds for raw executemany of ready tuples into the plain table, one transaction per
    *chunk* iterations: ``plain (run INTEGER, step INTEGER, key TEXT, value REAL)``, no key, no
    index (the issue's floor)."""
    path = fresh_db(folder, "raw.sqlite")
    conn = store.connect(path, create=True)
    conn.execute("CREATE TABLE plain (run INTEGER, step INTEGER, key TEXT, value REAL)")
    chunks = [
        [
            (1, i, key, value(i, j))
            for i in range(s + 1, min(s + chunk, iterations) + 1)
            for j, key in enumerate(KEYS)
        ]
        for s in range(0, iterations, chunk)
    ]
    start = time.perf_counter()
    for rows in chunks:
        conn.execute("BEGIN")
        conn.executemany(PLAIN, rows)
        conn.execute("COMMIT")
    elapsed = time.perf_counter() - start
    conn.close()
    return elapsed


def bytes_per_row(folder: Path, iterations: int) -> float:
    """The plugin's file size (WAL checkpointed) per record, for *iterations* x 10 records."""
    plugin_write(folder, iterations, iterations)
    path = folder / "plugin.sqlite"
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    pages, free, size = (
        conn.execute(f"PRAGMA {p}").fetchone()[0] for p in ("page_count", "freelist_count", "page_size")
    )
    conn.close()
    return (pages - free) * size / (iterations * len(KEYS))


def query_times(folder: Path, repeats: int) -> dict[str, float]:
    """Seconds to read one key of a 1e6-row run: in process (what ``log show --keys`` and
    ``log plot`` read), and ``epochal log show`` / ``epochal log plot`` as subprocesses."""
    import subprocess
    import sys

    from epochal_sqlite import plot

    iterations = 100_000
    loop = FakeLoop(iterations, window=0)
    path = fresh_db(folder, "big.sqlite")
    plugin = SQLiteLog(path=str(path), flush_seconds=0)
    plugin.before_training(loop)  # type: ignore[arg-type]
    for end in range(1000, iterations + 1, 1000):  # flushes of the default size
        loop.iteration = end
        plugin.flush(loop)  # type: ignore[arg-type]
    plugin.close()
    epochal = str(Path(sys.executable).with_name("epochal"))
    show = [epochal, "log", "show", loop.run_id, "--db", str(path), "--keys", KEYS[3], "--csv"]
    png = folder / "plot.png"
    draw = [epochal, "log", "plot", loop.run_id, "--db", str(path), "--key", KEYS[3], "-o", str(png)]

    def timeline() -> float:
        start = time.perf_counter()
        with store.Reader(path) as reader:
            rows = reader.timeline(reader.resolve(loop.run_id), [KEYS[3]])
        assert len(rows) == iterations
        return time.perf_counter() - start

    def series() -> float:
        start = time.perf_counter()
        with store.Reader(path) as reader:
            found = plot.read_series(reader, [reader.resolve(loop.run_id)], [KEYS[3]], True)
        assert len(found[0].xs) == iterations
        return time.perf_counter() - start

    def command(argv: list[str]) -> Callable[[], float]:
        def run() -> float:
            start = time.perf_counter()
            subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
            return time.perf_counter() - start

        return run

    return median_of(
        repeats,
        {
            "Reader.timeline, one key": timeline,
            "plot.read_series, one key": series,
            "epochal log show --keys KEY --csv": command(show),
            "epochal log plot --key KEY -o x.png": command(draw),
            "python -c pass": command([sys.executable, "-c", "pass"]),
            "python -c 'import matplotlib.pyplot'": command(
                [sys.executable, "-c", "import matplotlib.pyplot"]
            ),
        },
    )


class Recorder:
    """Writes the 10 outputs of every batch into the log row (what a monitor plugin does)."""

    @hookimpl
    def after_batch(self, loop: Any, outputs: Mapping[str, Any]) -> None:
        row = loop.log.current_row
        for key, value in outputs.items():
            row["train." + key] = value


def loop_seconds(folder: Path, batches: int, with_sqlite: bool) -> float:
    plugins: dict[str, object] = {"recorder": Recorder()}
    if with_sqlite:
        plugins["sqlite_log"] = SQLiteLog(path=str(fresh_db(folder, "loop.sqlite")))
    model = NoOpModel(OUTPUTS, eval_outputs={})
    loop = Loop(model, {"train": [[0]] * batches}, plugins=plugins, max_epochs=1, handle_signals=False)
    start = time.perf_counter()
    loop.run()
    return time.perf_counter() - start


def after_batch_ns(folder: Path, calls: int) -> float:
    loop = FakeLoop(0)
    plugin = SQLiteLog(path=str(fresh_db(folder, "hook.sqlite")), flush_every=10**9)
    plugin.before_training(loop)  # type: ignore[arg-type]
    hook = plugin.after_batch
    start = time.perf_counter()
    for _ in range(calls):
        hook(loop)  # type: ignore[arg-type]
    elapsed = time.perf_counter() - start
    plugin.close()
    return elapsed / calls * 1e9


def open_times(folder: Path, repeats: int) -> dict[str, float]:
    """Seconds to open and close a run's log: a new file, an existing file, the peers' log."""
    from peers_setups import SQLiteSink  # beside this file

    existing = fresh_db(folder, "existing.sqlite")
    store.connect(existing, create=True).close()
    made = itertools.count()

    def new_file() -> float:
        path = folder / f"new{next(made)}.sqlite"
        start = time.perf_counter()
        store.connect(path, create=True).close()
        return time.perf_counter() - start

    def existing_file() -> float:
        start = time.perf_counter()
        store.connect(existing, create=True).close()
        return time.perf_counter() - start

    def peers_log() -> float:
        sink = SQLiteSink(folder / f"peers{next(made)}.sqlite")
        start = time.perf_counter()
        sink.open()
        sink.close()
        return time.perf_counter() - start

    return median_of(
        repeats,
        {
            "store.connect, new file (+ close)": new_file,
            "store.connect, existing file (+ close)": existing_file,
            "bench/peers.py's SQLiteSink, new file (open + close)": peers_log,
        },
    )


def median_of(repeats: int, functions: Mapping[str, Callable[[], float]]) -> dict[str, float]:
    samples: dict[str, list[float]] = {name: [] for name in functions}
    for _ in range(repeats):
        for name, function in functions.items():  # alternate, so drifts hit every variant alike
            samples[name].append(function())
    return {name: statistics.median(values) for name, values in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rows and repeats")
    args = parser.parse_args()
    iterations, repeats, batches = (5_000, 3, 20_000) if args.quick else (20_000, 7, 100_000)
    records = iterations * len(KEYS)
    folder = Path(tempfile.mkdtemp(prefix="epochal-sqlite-bench-"))
    try:
        write = median_of(
            repeats,
            {
                "raw plain table, 1 transaction": lambda: raw_write(folder, iterations, iterations),
                "plugin, 1 flush": lambda: plugin_write(folder, iterations, iterations),
                "raw plain table, commit every 1,000 iterations": lambda: raw_write(folder, iterations, 1000),
                "plugin, flush every 1,000 iterations": lambda: plugin_write(folder, iterations, 1000),
            },
        )
        loops = median_of(
            repeats,
            {
                "no-op loop + 10-metric recorder": lambda: loop_seconds(folder, batches, False),
                "... + sqlite_log": lambda: loop_seconds(folder, batches, True),
            },
        )
        hook = median_of(repeats, {"after_batch, no flush due": lambda: after_batch_ns(folder, 200_000)})
        size = bytes_per_row(folder, iterations)
        reads = query_times(folder, max(3, repeats // 2))
        opens = open_times(folder, 10 * repeats)
    finally:
        shutil.rmtree(folder, ignore_errors=True)

    floor = records / write["raw plain table, 1 transaction"]
    print(f"epochal-sqlite write path: {iterations:,} iterations x {len(KEYS)} metrics = {records:,} rows")
    print(f"  (medians of {repeats}, sqlite {sqlite3.sqlite_version}, {os.cpu_count()} CPUs)")
    for name, seconds in write.items():
        rate = records / seconds
        print(f"  {name:<52} {rate / 1e3:8.0f} k rows/s  {rate / floor:5.2f}x floor")
    plain = write["raw plain table, 1 transaction"] / write["plugin, 1 flush"]
    print(f"  plugin (1 flush) / raw plain table (1 transaction): {plain:.2f}x  (target >= 0.8x)")
    chunked = (
        write["raw plain table, commit every 1,000 iterations"]
        / write["plugin, flush every 1,000 iterations"]
    )
    print(f"  plugin / raw plain table, both committing every 1,000 iterations: {chunked:.2f}x")
    print(f"  plugin file: {size:.1f} bytes per numeric row (target <= 30)")
    print("reading one key of a 1e6-row run (100,000 iterations x 10 keys):")
    for name, seconds in reads.items():
        print(f"  {name:<40} {seconds * 1e3:7.0f} ms")
    bare, with_sqlite = loops["no-op loop + 10-metric recorder"], loops["... + sqlite_log"]
    print(f"per-batch overhead, no-op loop, 10 metrics per batch, {batches:,} batches:")
    print(f"  loop + recorder          {bare / batches * 1e9:8.0f} ns/batch")
    print(f"  loop + recorder + sqlite {with_sqlite / batches * 1e9:8.0f} ns/batch")
    print(
        f"  sqlite_log adds          {(with_sqlite - bare) / batches * 1e9:8.0f} ns/batch (writes included)"
    )
    print(f"  after_batch alone        {hook['after_batch, no flush due']:8.0f} ns/call (no flush due)")
    print("opening a run's log:")
    for name, seconds in opens.items():
        print(f"  {name:<52} {seconds * 1e3:6.2f} ms")


if __name__ == "__main__":
    main()
