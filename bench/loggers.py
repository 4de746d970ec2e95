"""Benchmark: what each logger plugin costs the training loop, per record, vs sqlite_log.

A no-op loop (``train_step`` returns 10 ready metrics; a plugin copies them into the log row)
of ITERATIONS batches in one epoch, with no logger, with ``sqlite_log`` (defaults), with
``tensorboard`` (defaults) and with ``mlflow`` (defaults: a local SQLite store in the run dir,
records handed to its background thread every 100 iterations). Two figures per logger:

- loop: seconds from the first batch to the start of ``after_training`` (what the training
  waits for while the logger works; the mlflow thread's sending runs meanwhile on the other
  core), minus the no-logger loop, per record;
- end: seconds of the loggers' ``after_training`` (the last flush; for mlflow, waiting for the
  thread to send what is left, log the config and end the MLflow run).

Medians of alternating repeats, measured side by side in one run. Usage:
``python bench/loggers.py [--quick]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from _common import NoOpModel

from epochal import Loop, hookimpl

KEYS = [f"metric{j}" for j in range(10)]
OUTPUTS = dict.fromkeys(KEYS, 0.5)


class Copy:
    @hookimpl
    def after_batch(self, loop: Any, outputs: Mapping[str, Any]) -> None:
        row = loop.log.current_row
        for key, value in outputs.items():
            row[f"train.{key}"] = value + loop.iteration


class Clock:
    """Placed first: its after_batch sees the first batch, its after_training runs before the loggers'."""

    def __init__(self) -> None:
        self.start = self.stop = 0.0

    @hookimpl
    def after_batch(self, loop: Any) -> None:
        if loop.iteration == 1:
            self.start = time.perf_counter()

    @hookimpl
    def after_training(self) -> None:
        self.stop = time.perf_counter()


def logger(name: str, folder: Path) -> Any:
    if name == "sqlite_log":
        from epochal_sqlite import SQLiteLog

        return SQLiteLog()
    if name == "tensorboard":
        from epochal_tensorboard import TensorBoard

        return TensorBoard()
    if name == "mlflow":
        from epochal_mlflow import MLflow

        return MLflow()
    raise ValueError(name)


def once(name: str | None, iterations: int) -> tuple[float, float]:
    """(loop seconds, end seconds) of one run."""
    with tempfile.TemporaryDirectory() as tmp:
        clock = Clock()
        plugins: dict[str, Any] = {"clock": clock, "copy": Copy()}
        if name:
            plugins[name] = logger(name, Path(tmp))
        loop = Loop(
            NoOpModel(OUTPUTS, eval_outputs={}),
            {"train": [[0]] * iterations},
            plugins=plugins,
            run_dir=Path(tmp) / "run",
            max_epochs=1,
            handle_signals=False,
        )
        loop.run()
        end = time.perf_counter()
        return clock.stop - clock.start, end - clock.stop


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    iterations, repeats = (2_000, 3) if args.quick else (10_000, 5)
    names: list[str | None] = [None, "sqlite_log", "tensorboard", "mlflow"]
    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
    import logging

    logging.getLogger("mlflow").setLevel(logging.WARNING)
    warnings.simplefilter("ignore")
    once("mlflow", 10)  # imports and the first SQLite store creation out of the way
    once("tensorboard", 10)
    loops: dict[str | None, list[float]] = {n: [] for n in names}
    ends: dict[str | None, list[float]] = {n: [] for n in names}
    for _ in range(repeats):
        for name in names:
            loop_s, end_s = once(name, iterations)
            loops[name].append(loop_s)
            ends[name].append(end_s)
    records = (iterations - 1) * len(KEYS)
    base = statistics.median(loops[None])
    print(f"{iterations} iterations x {len(KEYS)} records, median of {repeats}")
    print(f"no logger: loop {base / (iterations - 1) * 1e9:.0f} ns per batch")
    per_record = {}
    for name in names[1:]:
        extra = statistics.median(loops[name]) - base
        per_record[name] = extra / records
    for name in names[1:]:
        print(
            f"{name:12s} loop +{per_record[name] * 1e9:7.0f} ns/record "
            f"({per_record[name] / per_record['sqlite_log']:.2f}x sqlite_log)   "
            f"end {statistics.median(ends[name]) * 1e3:8.1f} ms"
        )


if __name__ == "__main__":
    main()
