"""The cost of a record written into the training log every step, with and without the window.

A plugin that records every step (``monitor`` with ``every_n_batches = 1``) makes the log create
one row per step, and the window (``EPOCHAL_LOG_WINDOW``, 1024 rows by default) moves every row
to the spill once it is 1024 rows old. Measured per row, median of interleaved repeats:

* ``dict``: the floor, ``rows.setdefault(i, {})[key] = value`` into a plain dict;
* ``log, no window``: ``log.current_row[key] = value`` keeping every row in memory;
* ``log, window 1024``: the same with the default window (rows spilled as the log advances);
* ``peek 1000 rows``: what ``sqlite_log`` reads at each flush (``log.peek(range(...))``), per
  row, with every row resident, and with the rows 3 windows back (spilled).

    python bench/log_records.py [--rows 20000] [--repeats 9]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Callable

from epochal.log import TrainingLog

KEY = "train.loss.running"


def fill(log: TrainingLog, clock: list[int], rows: int) -> float:
    start = time.perf_counter()
    for i in range(rows):
        clock[0] = i + 1
        log.current_row[KEY] = 0.5
    return time.perf_counter() - start


def per_row_dict(rows: int) -> float:
    table: dict[int, dict[str, float]] = {}
    clock = [0]
    start = time.perf_counter()
    for i in range(rows):
        clock[0] = i + 1
        table.setdefault(clock[0], {})[KEY] = 0.5
    return (time.perf_counter() - start) / rows


def per_row_log(window: int) -> Callable[[int], float]:
    def run(rows: int) -> float:
        clock = [0]
        return fill(TrainingLog(lambda: clock[0], window=window), clock, rows) / rows

    return run


def per_row_peek(back: int) -> Callable[[int], float]:
    def run(rows: int) -> float:
        clock = [0]
        log = TrainingLog(lambda: clock[0], window=1024)
        fill(log, clock, rows)
        end = clock[0] - back
        start = time.perf_counter()
        log.peek(range(end - 1000, end + 1))
        return (time.perf_counter() - start) / 1001

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    cases: dict[str, Callable[[int], float]] = {
        "dict": per_row_dict,
        "log, no window": per_row_log(0),
        "log, window 1024": per_row_log(1024),
        "peek 1000 rows, resident": per_row_peek(0),
        "peek 1000 rows, spilled": per_row_peek(3 * 1024),
    }
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.repeats):
        for name, run in cases.items():
            gc.collect()
            gc.disable()
            try:
                samples[name].append(run(args.rows) * 1e9)
            finally:
                gc.enable()
    floor = statistics.median(samples["dict"])
    print(f"{args.rows} rows of one record, median of {args.repeats} interleaved repeats")
    print()
    print("| case | ns / row | × dict |")
    print("|---|---:|---:|")
    for name, values in samples.items():
        value = statistics.median(values)
        print(f"| {name} | {value:.0f} | {value / floor:.2f} |")


if __name__ == "__main__":
    main()
