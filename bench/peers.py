"""Per-step overhead of epochal against PyTorch Ignite and PyTorch Lightning, side by side in one run.

What is measured: the wall time of whole training runs of a no-op model (its train step returns a
constant), divided by the number of training steps, so what is left is the framework's own cost
per step, its features' per-step costs and their per-epoch costs amortised over the epoch.
Every framework trains ``EPOCHS`` epochs of ``STEPS`` tiny batches on the CPU; the timed part is
the run call only (``Loop.run()``, ``Engine.run()``, ``Trainer.fit()``), which includes each
framework's own start-up and tear-down inside that call (opening the SQLite file, the Trainer's
setup). Objects are built, and temp folders made, before the clock starts. The cases:

* ``bare python``: a ``for`` loop calling the no-op train step (the floor).
* ``<framework> bare``: the engine alone, no handlers/callbacks/logger/progress bar/checkpoint,
  no validation.
* ``<framework> + features``: the same features in every framework, with a validation stream of
  ``VALID_STEPS`` batches after every epoch:

  - metrics: epochal ``monitor`` (every_n_batches=1: a record per step and the epoch's mean);
    Ignite ``RunningAverage`` + ``Average`` on the output; Lightning ``self.log(on_step, on_epoch)``.
  - early stopping on the validation loss, never triggering: ``early_stopping`` (patience=1e9);
    Ignite ``EarlyStopping`` on the evaluator; Lightning ``EarlyStopping(val_loss, patience=1e9)``.
  - a checkpoint every epoch: ``checkpoint`` (every_n_epochs=1); Ignite ``ModelCheckpoint`` on
    EPOCH_COMPLETED; Lightning ``ModelCheckpoint(every_n_epochs=1)``. epochal's save is durable
    (its files and directories fsynced); Ignite's and Lightning's fsync nothing. ``ignite +
    features[...], durable checkpoint`` is Ignite's ``Checkpoint`` + ``DiskSaver`` (what
    ``ModelCheckpoint`` is) with the file fsynced before its rename and the directory after.
  - a SQLite log of every step's loss and the epoch's records, one transaction per epoch:
    ``sqlite_log`` (flush_every=0, flush_seconds=0: never by count or time); a handler / a
    Callback (``SQLiteSink``).
  - timing: ``timing`` (per-plugin hook timers); Ignite ``HandlersTimeProfiler`` (per handler);
    Lightning ``Timer`` callback.
  - progress bars (train and validation): ``progress`` (force, mininterval=0.1); Ignite
    ``ProgressBar`` on ITERATION_COMPLETED filtered to at most one event per 0.1 s, counted from
    the epoch's (the evaluation's) start, the same rate (every 100 iterations and its default, a
    redraw on every step, are measured too); Lightning ``TQDMProgressBar(refresh_rate=500)``.

  ``<framework> + features (epoch records)`` is the same without per-step records: epochal's
  monitor with ``every_n_batches = 0`` (no running record), Ignite without RunningAverage and
  step rows; the SQLite log then holds only the epochs' records. ``<framework> + features (a
  record every 50 steps)`` writes the running record every 50 steps only: epochal's monitor with
  its default (``every_n_batches = 50``, the mean of the 50 steps), Ignite's RunningAverage
  logged every 50 iterations (Lightning's ``self.log(on_step=True)`` above logs every 50 steps
  too: its ``log_every_n_steps`` default).

Progress bars draw to ``os.devnull`` (stdout and stderr are redirected during every run, of every
case). Repeats are interleaved (every case once per round) so drifts of the shared machine hit all
cases alike; the garbage collector is collected before and disabled during each timed run. The
figure reported is the median over ``REPEATS`` rounds, of the wall time and of the process's CPU
time (which leaves out fsync waits and a shared machine's other jobs). Run:
``python bench/peers.py`` (needs ``pip install -r bench/requirements-peers.txt``);
``BENCH_EPOCHS``, ``BENCH_STEPS``, ``BENCH_REPEATS`` override the sizes;
``BENCH_ONLY=epochal,ignite`` restricts the frameworks.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.metadata
import logging
import os
import platform
import shutil
import sqlite3
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

import epochal

EPOCHS = int(os.environ.get("BENCH_EPOCHS", "5"))
STEPS = int(os.environ.get("BENCH_STEPS", "1000"))
VALID_STEPS = int(os.environ.get("BENCH_VALID_STEPS", "10"))
REPEATS = int(os.environ.get("BENCH_REPEATS", "7"))
ONLY = {name for name in os.environ.get("BENCH_ONLY", "").split(",") if name}

#: a run: built (untimed) in a temp folder, returns the zero-argument call that is timed.
Setup = Callable[[Path], Callable[[], Any]]


# -- shared pieces ------------------------------------------------------------------------------


class SQLiteSink:
    """The SQLite log of the peers: (run, iteration, key, value) rows, one transaction per flush.

    Same pragmas as epochal's sqlite_log (WAL, synchronous=NORMAL); rows are buffered in memory and
    written with ``executemany`` at every epoch end.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.rows: list[tuple[str, int, str, float]] = []
        self.conn: sqlite3.Connection | None = None

    def open(self) -> None:
        """Create the database and its table."""
        conn = sqlite3.connect(self.path, isolation_level=None)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.execute(
            "CREATE TABLE IF NOT EXISTS log (run_id TEXT, iteration INTEGER, key TEXT, value REAL, "
            "PRIMARY KEY (run_id, iteration, key))"
        )
        self.conn = conn

    def flush(self) -> None:
        """Write the buffered rows in one transaction."""
        assert self.conn is not None
        self.conn.execute("BEGIN IMMEDIATE")
        self.conn.executemany("INSERT OR REPLACE INTO log VALUES (?, ?, ?, ?)", self.rows)
        self.conn.execute("COMMIT")
        self.rows = []

    def close(self) -> None:
        """Flush what is left and close."""
        if self.conn is not None:
            self.flush()
            self.conn.close()
            self.conn = None


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Send stdout and stderr (progress bars, tables, warnings) to os.devnull."""
    with (
        open(os.devnull, "w") as devnull,
        contextlib.redirect_stdout(devnull),
        contextlib.redirect_stderr(devnull),
    ):
        yield


def version(dist: str) -> str:
    """The installed version of *dist*, or 'absent'."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


# -- bare Python --------------------------------------------------------------------------------


def bare_python(tmp: Path) -> Callable[[], Any]:
    """A ``for`` loop over epochs and batches calling a no-op train step."""
    batches = [np.zeros((1, 1), np.float32)] * STEPS

    def train_step(batch: Any) -> dict[str, float]:
        return {"loss": 0.0}

    def run() -> None:
        for _ in range(EPOCHS):
            for batch in batches:
                train_step(batch)

    return run


# -- epochal ------------------------------------------------------------------------------------


class NoOpModel:
    """An epochal model whose steps return a constant; a 2-float array as its state."""

    def __init__(self) -> None:
        self.w = np.zeros(2, np.float32)

    def train_step(self, batch: Any) -> dict[str, float]:
        return {"loss": 0.0}

    def eval_step(self, batch: Any) -> dict[str, float]:
        return {"loss": 0.0}

    def state_dict(self) -> dict[str, Any]:
        return {"w": self.w}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.w = state["w"]


EPOCHAL_ORDER = ["monitor", "early_stopping", "checkpoint", "sqlite_log", "timing", "progress"]


def epochal_options(step_records: int) -> dict[str, dict[str, Any]]:
    """The six standard plugins' options for the features above (*step_records*: a running
    record every so many steps, 0 = none; True = 1)."""
    return {
        "monitor": {"every_n_batches": int(step_records)},
        "early_stopping": {"patience": 10**9},
        "checkpoint": {"every_n_epochs": 1},
        # one transaction per epoch, as for the peers: no flush by row count or by time
        "sqlite_log": {"flush_every": 0, "flush_seconds": 0.0},
        "timing": {"table": False},
        "progress": {"force": True, "mininterval": 0.1},
    }


def epochal_bare(tmp: Path) -> Callable[[], Any]:
    """epochal's Loop with no plugin and no eval stream."""
    plugins = epochal.load_plugins(order=[], autoload=False)
    batches = [np.zeros((1, 1), np.float32)] * STEPS
    loop = epochal.Loop(
        NoOpModel(), {"train": batches}, plugins=plugins, max_epochs=EPOCHS, handle_signals=False
    )
    return loop.run


def make_epochal_features(
    step_records: int, only: str | None = None, async_save: bool = False, without: str | None = None
) -> Setup:
    """epochal's Loop with the six standard plugins (or only the plugin *only*, or none when
    *only* is ``""``, or all but *without*) and a validation stream; with *async_save* the
    checkpoint's writes (and their fsyncs, which Ignite's DiskSaver does not do) run in a
    background thread."""

    def setup(tmp: Path) -> Callable[[], Any]:
        order = [p for p in EPOCHAL_ORDER if p != without] if only is None else [only] if only else []
        options = {name: opts for name, opts in epochal_options(step_records).items() if name in order}
        if async_save and "checkpoint" in options:
            options["checkpoint"] = {**options["checkpoint"], "async_save": True}
        plugins = epochal.load_plugins(order=order, autoload=False, options=options)
        data = {
            "train": [np.zeros((1, 1), np.float32)] * STEPS,
            "valid": [np.zeros((1, 1), np.float32)] * VALID_STEPS,
        }
        # the run directory inside *tmp*: sqlite_log's default file (beside the run directory) is
        # then tmp/epochal.sqlite, new for every run and removed with it, as the peers' SQLiteSink
        loop = epochal.Loop(
            NoOpModel(), data, plugins=plugins, max_epochs=EPOCHS, run_dir=tmp / "run", handle_signals=False
        )
        return loop.run

    return setup


# -- PyTorch Ignite -----------------------------------------------------------------------------


def ignite_bare(tmp: Path) -> Callable[[], Any]:
    """Ignite's Engine with no handler."""
    import torch
    from ignite.engine import Engine

    batches = [torch.zeros(1, 1)] * STEPS

    def train_step(engine: Engine, batch: Any) -> dict[str, float]:
        return {"loss": 0.0}

    trainer = Engine(train_step)
    return lambda: trainer.run(batches, max_epochs=EPOCHS)


def make_ignite_features(bar: str, step_records: int = True, durable: bool = False) -> Setup:
    """Ignite's Engine with handlers equivalent to epochal's six plugins, and an evaluator.

    Ignite's ProgressBar redraws on every event it is attached to (``set_description`` and
    ``set_postfix`` refresh the bar, bypassing tqdm's ``mininterval``), so its events are
    filtered: *bar* ``"0.1s"`` lets an event through when 0.1 s passed since the epoch (or the
    evaluation) started or since the last one let through, as epochal's ``progress`` draws with
    ``mininterval = 0.1`` (no frame in the first 0.1 s either); ``"every100"`` every 100
    iterations (the throttle of earlier figures); ``"every"`` on every iteration (Ignite's
    default). Without *step_records*, as epochal's monitor with ``every_n_batches = 0``: no running
    average, no step rows in SQLite; with an int, a step row every that many iterations.
    """

    def setup(tmp: Path) -> Callable[[], Any]:
        return ignite_features(tmp, bar, step_records, durable)

    return setup


def every_seconds(seconds: float) -> tuple[Callable[[Any], None], Callable[[Any, int], bool]]:
    """An Ignite event filter that lets an event through when *seconds* passed since the last
    one let through, or since ``start`` (attach it to the epoch's or the run's start)."""
    due = [0.0]
    clock = time.perf_counter

    def start(engine: Any) -> None:
        due[0] = clock() + seconds

    def event_filter(engine: Any, event: int) -> bool:
        now = clock()
        if now < due[0]:
            return False
        due[0] = now + seconds
        return True

    return start, event_filter


def durable_disk_saver(dirname: Path) -> Any:
    """Ignite's ``DiskSaver`` (temp file, then rename) made as durable as epochal's checkpoint:
    the file fsynced before its rename, the directory fsynced after it."""
    from ignite.handlers import DiskSaver

    class DurableDiskSaver(DiskSaver):
        def _save_func(self, checkpoint: Any, path: Any, func: Callable[..., Any]) -> None:
            def save_and_sync(obj: Any, file: Any, **kwargs: Any) -> None:
                func(obj, file, **kwargs)
                file.flush()
                os.fsync(file.fileno())

            super()._save_func(checkpoint, path, save_and_sync)
            fd = os.open(os.path.dirname(path), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    return DurableDiskSaver(str(dirname), require_empty=False)


def ignite_features(tmp: Path, bar: str, step_records: int, durable: bool = False) -> Callable[[], Any]:
    """See :func:`make_ignite_features`."""
    import torch
    from ignite.contrib.handlers import ProgressBar
    from ignite.engine import Engine, Events
    from ignite.handlers import Checkpoint, EarlyStopping, HandlersTimeProfiler, ModelCheckpoint
    from ignite.metrics import Average, RunningAverage

    model = torch.nn.Linear(1, 1)
    batches = [torch.zeros(1, 1)] * STEPS
    valid = [torch.zeros(1, 1)] * VALID_STEPS

    def train_step(engine: Engine, batch: Any) -> dict[str, float]:
        return {"loss": 0.0}

    def eval_step(engine: Engine, batch: Any) -> dict[str, float]:
        return {"loss": 0.0}

    trainer = Engine(train_step)
    evaluator = Engine(eval_step)
    # monitor: a running value per step and the epoch's mean
    if step_records:
        RunningAverage(output_transform=lambda out: out["loss"]).attach(trainer, "loss")
    Average(output_transform=lambda out: out["loss"]).attach(trainer, "epoch_loss")
    Average(output_transform=lambda out: out["loss"]).attach(evaluator, "loss")

    @trainer.on(Events.EPOCH_COMPLETED)
    def validate(engine: Engine) -> None:
        evaluator.run(valid)

    # early stopping on the validation loss (never triggers)
    stopper = EarlyStopping(
        patience=10**9, score_function=lambda engine: -engine.state.metrics["loss"], trainer=trainer
    )
    evaluator.add_event_handler(Events.COMPLETED, stopper)
    # a checkpoint every epoch
    if durable:  # what ModelCheckpoint is (Checkpoint + DiskSaver), with fsyncs
        durable_saver = Checkpoint(
            {"model": model}, durable_disk_saver(tmp / "checkpoints"), "bench", n_saved=3
        )
        trainer.add_event_handler(Events.EPOCH_COMPLETED, durable_saver)
    else:
        saver = ModelCheckpoint(tmp / "checkpoints", filename_prefix="bench", n_saved=3, require_empty=False)
        trainer.add_event_handler(Events.EPOCH_COMPLETED, saver, {"model": model})
    # SQLite log: every step's running loss, the epoch's records, one transaction per epoch
    sink = SQLiteSink(tmp / "log.sqlite")
    trainer.add_event_handler(Events.STARTED, lambda engine: sink.open())

    if step_records:

        @trainer.on(Events.ITERATION_COMPLETED(every=int(step_records)))
        def log_step(engine: Engine) -> None:
            sink.rows.append(
                ("run", engine.state.iteration, "train.loss.running", engine.state.metrics["loss"])
            )

    @trainer.on(Events.EPOCH_COMPLETED)
    def log_epoch(engine: Engine) -> None:
        step = engine.state.iteration
        sink.rows.append(("run", step, "train.loss", float(engine.state.metrics["epoch_loss"])))
        sink.rows.append(("run", step, "valid.loss", float(evaluator.state.metrics["loss"])))
        sink.flush()

    trainer.add_event_handler(Events.COMPLETED, lambda engine: sink.close())
    # progress bars, train and eval, drawn to devnull, throttled as *bar* says
    devnull = open(os.devnull, "w")  # noqa: SIM115 - closed when the run ends
    shown = ["loss"] if step_records else ["epoch_loss"]
    if bar == "0.1s":
        train_start, train_due = every_seconds(0.1)
        trainer.add_event_handler(Events.EPOCH_STARTED, train_start)
        eval_start, eval_due = every_seconds(0.1)
        evaluator.add_event_handler(Events.STARTED, eval_start)
        train_event = Events.ITERATION_COMPLETED(event_filter=train_due)
        eval_event = Events.ITERATION_COMPLETED(event_filter=eval_due)
    elif bar == "every100":  # as in earlier figures: the validation bar redrawn every step
        train_event, eval_event = Events.ITERATION_COMPLETED(every=100), Events.ITERATION_COMPLETED
    else:
        train_event = eval_event = Events.ITERATION_COMPLETED
    ProgressBar(file=devnull, mininterval=0.1).attach(trainer, metric_names=shown, event_name=train_event)
    ProgressBar(file=devnull, mininterval=0.1).attach(evaluator, event_name=eval_event)
    trainer.add_event_handler(Events.COMPLETED, lambda engine: devnull.close())
    # timing of every handler (attached last: it wraps the handlers when the run starts)
    HandlersTimeProfiler().attach(trainer)
    return lambda: trainer.run(batches, max_epochs=EPOCHS)


# -- PyTorch Lightning --------------------------------------------------------------------------


def lightning_module(features: bool) -> Any:
    """A LightningModule whose training step returns a constant tensor requiring grad."""
    import lightning.pytorch as pl
    import torch

    class NoOpModule(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(1, 1)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = torch.zeros((), requires_grad=True)
            if features:
                self.log("loss", loss, on_step=True, on_epoch=True)
            return loss

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            self.log("val_loss", torch.zeros(()), on_step=False, on_epoch=True)

        def configure_optimizers(self) -> None:
            return None

    return NoOpModule()


def lightning_sqlite_callback(path: Path) -> Any:
    """A Lightning Callback writing every step's loss and the epoch's records to SQLite."""
    import lightning.pytorch as pl

    class SQLiteCallback(pl.Callback):
        def __init__(self) -> None:
            self.sink = SQLiteSink(path)

        def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            self.sink.open()

        def on_train_batch_end(
            self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
        ) -> None:
            self.sink.rows.append(("run", trainer.global_step, "train.loss", float(outputs["loss"])))

        def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            step = trainer.global_step
            for key, value in trainer.callback_metrics.items():
                self.sink.rows.append(("run", step, key, float(value)))
            self.sink.flush()

        def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            self.sink.close()

    return SQLiteCallback()


def lightning_trainer(tmp: Path, callbacks: list[Any], features: bool) -> Any:
    """A CPU Trainer for EPOCHS epochs, no model summary, no sanity check."""
    import lightning.pytorch as pl

    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=EPOCHS,
        logger=False,
        callbacks=callbacks,
        enable_checkpointing=features,
        enable_progress_bar=features,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=tmp,
    )


class Batches:
    """A re-iterable sequence of batches that Lightning takes as one data loader (a list is many)."""

    def __init__(self, items: list[Any]) -> None:
        self.items = items

    def __iter__(self) -> Iterator[Any]:
        return iter(self.items)

    def __len__(self) -> int:
        return len(self.items)


def lightning_bare(tmp: Path) -> Callable[[], Any]:
    """Lightning's Trainer with no callback, logger, checkpoint or progress bar; no validation."""
    import torch

    module = lightning_module(features=False)
    trainer = lightning_trainer(tmp, [], features=False)
    batches = Batches([torch.zeros(1, 1)] * STEPS)
    return lambda: trainer.fit(module, train_dataloaders=batches)


def lightning_features(tmp: Path) -> Callable[[], Any]:
    """Lightning's Trainer with callbacks equivalent to epochal's six plugins, and validation."""
    import torch
    from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint, Timer, TQDMProgressBar

    callbacks = [
        ModelCheckpoint(dirpath=tmp / "checkpoints", every_n_epochs=1, save_top_k=-1),
        EarlyStopping(monitor="val_loss", patience=10**9),
        lightning_sqlite_callback(tmp / "log.sqlite"),
        Timer(),
        TQDMProgressBar(refresh_rate=500),
    ]
    module = lightning_module(features=True)
    trainer = lightning_trainer(tmp, callbacks, features=True)
    batches = Batches([torch.zeros(1, 1)] * STEPS)
    valid = Batches([torch.zeros(1, 1)] * VALID_STEPS)
    return lambda: trainer.fit(module, train_dataloaders=batches, val_dataloaders=valid)


# -- measuring ----------------------------------------------------------------------------------


def cases() -> dict[str, tuple[str, Setup]]:
    """name → (framework, setup) of every case to measure."""
    table: dict[str, tuple[str, Setup]] = {
        "bare python": ("python", bare_python),
        "epochal bare": ("epochal", epochal_bare),
        "epochal + features": ("epochal", make_epochal_features(step_records=True)),
        "epochal + features (epoch records)": ("epochal", make_epochal_features(step_records=False)),
        "epochal + features, async checkpoint": ("epochal", make_epochal_features(True, async_save=True)),
        "epochal + features (a record every 50 steps)": ("epochal", make_epochal_features(step_records=50)),
        "ignite bare": ("ignite", ignite_bare),
        "ignite + features": ("ignite", make_ignite_features("0.1s")),
        "ignite + features (epoch records)": ("ignite", make_ignite_features("0.1s", step_records=False)),
        "ignite + features (a record every 50 steps)": (
            "ignite",
            make_ignite_features("0.1s", step_records=50),
        ),
        "ignite + features, durable checkpoint": ("ignite", make_ignite_features("0.1s", durable=True)),
        "ignite + features (epoch records), durable checkpoint": (
            "ignite",
            make_ignite_features("0.1s", step_records=False, durable=True),
        ),
        "ignite + features, bar every 100 iterations": ("ignite", make_ignite_features("every100")),
        "ignite + features, bar redrawn every step": ("ignite", make_ignite_features("every")),
        "lightning bare": ("lightning", lightning_bare),
        "lightning + features": ("lightning", lightning_features),
    }
    table["epochal + validation, no plugin"] = ("epochal-ablation", make_epochal_features(True, only=""))
    for plugin in EPOCHAL_ORDER:
        table[f"epochal + validation + {plugin} only"] = (
            "epochal-ablation",
            make_epochal_features(True, only=plugin),
        )
    wanted = ONLY | {"python"} | ({"epochal-ablation"} if "epochal" in ONLY else set())
    return {name: case for name, case in table.items() if not ONLY or case[0] in wanted}


def time_run(setup: Setup) -> tuple[float, float]:
    """Seconds of one timed run built by *setup* in a fresh temp folder: wall and CPU time.

    The CPU time (``time.process_time``: every thread of the process) leaves out waiting for the
    disk (fsyncs) and for the other jobs of a shared machine, so it moves less between runs."""
    tmp = Path(tempfile.mkdtemp(prefix="epochal-peers-"))
    try:
        with quiet():
            run = setup(tmp)
            gc.collect()
            gc.disable()
            try:
                start, cpu = time.perf_counter(), time.process_time()
                run()
                elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
            finally:
                gc.enable()
        return elapsed, cpu
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def level_table(median: dict[str, float]) -> None:
    """The overhead per step of each level, each framework, and the peers' ratios to epochal."""
    floor = median["bare python"]
    print("| level | epochal µs | Ignite µs | Lightning µs | Ignite / epochal | Lightning / epochal |")
    print("|---|---:|---:|---:|---:|---:|")
    for level, suffix in (
        ("bare", " bare"),
        ("with features", " + features"),
        ("with features, epoch records only", " + features (epoch records)"),
        (
            "with features, a record every 50 steps (monitor's default)",
            " + features (a record every 50 steps)",
        ),
        ("with features, epochal's checkpoint async", " + features, async checkpoint"),
        ("with features, Ignite's checkpoint fsynced as epochal's", " + features, durable checkpoint"),
        (
            "with features, epoch records only, Ignite's checkpoint fsynced",
            " + features (epoch records), durable checkpoint",
        ),
    ):
        over = {
            fw: median[f"{fw}{suffix}"] - floor
            for fw in ("epochal", "ignite", "lightning")
            if f"{fw}{suffix}" in median
        }
        if suffix.endswith("async checkpoint"):  # the peers' rows of the synchronous case
            over.update(
                {
                    fw: median[f"{fw} + features"] - floor
                    for fw in ("ignite", "lightning")
                    if f"{fw} + features" in median
                }
            )
        if suffix.endswith("durable checkpoint"):  # epochal's row is its usual (durable) one
            plain = suffix.removesuffix(", durable checkpoint")
            if f"epochal{plain}" in median:
                over["epochal"] = median[f"epochal{plain}"] - floor
        if "epochal" not in over:
            continue
        base = over["epochal"]
        cells = [f"{over[fw]:.2f}" if fw in over else "" for fw in ("epochal", "ignite", "lightning")]
        ratios = [f"{over[fw] / base:.2f}×" if fw in over else "" for fw in ("ignite", "lightning")]
        print(f"| {level} | {' | '.join(cells)} | {' | '.join(ratios)} |")


def rounds(text: str) -> int:
    """The ``--rounds`` option's type in the bench scripts: a whole number, at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def silence_peers() -> None:
    """Silence the peers' warnings and info logs (no optimizer, few workers, GPU available...)."""
    warnings.filterwarnings("ignore")
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "pytorch_lightning", "ignite"):
        logging.getLogger(name).setLevel(logging.ERROR)


def main() -> None:
    """Measure every case, print the Markdown tables."""
    silence_peers()
    todo = cases()
    steps = EPOCHS * STEPS
    for _framework, setup in todo.values():  # warm-up: imports, first-run caches
        time_run(setup)
    samples: dict[str, list[float]] = {name: [] for name in todo}
    cpu_samples: dict[str, list[float]] = {name: [] for name in todo}
    for _ in range(REPEATS):
        for name, (_framework, setup) in todo.items():
            wall, cpu = time_run(setup)
            samples[name].append(wall / steps * 1e6)
            cpu_samples[name].append(cpu / steps * 1e6)
    median = {name: statistics.median(values) for name, values in samples.items()}
    cpu_median = {name: statistics.median(values) for name, values in cpu_samples.items()}

    print(
        f"{EPOCHS} epochs × {STEPS} steps (+ {VALID_STEPS} validation batches per epoch with features), "
        f"median of {REPEATS} interleaved runs; {time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores, "
        f"CPython {platform.python_version()}, epochal {version('epochal')}, torch {version('torch')}, "
        f"pytorch-ignite {version('pytorch-ignite')}, lightning {version('lightning')}"
    )
    print()
    print("| case | µs / step | min–max µs | × bare python | CPU µs / step |")
    print("|---|---:|---:|---:|---:|")
    floor = median["bare python"]
    for name, value in median.items():
        spread = f"{min(samples[name]):.2f}–{max(samples[name]):.2f}"
        print(f"| {name} | {value:.2f} | {spread} | {value / floor:.0f}× | {cpu_median[name]:.2f} |")
    print()
    print("Overhead per step = µs/step − bare python; ratio = peer overhead / epochal overhead.")
    print()
    level_table(median)
    print()
    print("The same in CPU time (process_time: no waiting for the disk or for other jobs):")
    print()
    level_table(cpu_median)
    ablation = {name: value for name, value in median.items() if todo[name][0] == "epochal-ablation"}
    if ablation:
        base = ablation.pop("epochal + validation, no plugin")
        print()
        print(f"epochal, one plugin at a time (with validation; the loop alone: {base:.2f} µs/step):")
        print()
        print("| plugin (options as above) | µs / step | added µs / step |")
        print("|---|---:|---:|")
        for name, value in ablation.items():
            plugin = name.removeprefix("epochal + validation + ").removesuffix(" only")
            print(f"| {plugin} | {value:.2f} | {value - base:+.2f} |")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
