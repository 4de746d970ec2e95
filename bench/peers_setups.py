"""The runs that ``bench/peers.py`` times: a bare Python loop, epochal, PyTorch Ignite and
PyTorch Lightning, each bare and with the same features (``bench/peers.py``'s docstring lists
them). A setup builds its run in a temp folder, untimed, and returns the call that is timed.

The sizes come from the environment (``BENCH_EPOCHS``, ``BENCH_STEPS``, ``BENCH_VALID_STEPS``);
a script that changes them at run time sets them here (``peers_setups.STEPS = n``).
"""

from __future__ import annotations

import os
import sqlite3
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
from _common import NoOpModel

import epochal

EPOCHS = int(os.environ.get("BENCH_EPOCHS", "5"))
STEPS = int(os.environ.get("BENCH_STEPS", "1000"))
VALID_STEPS = int(os.environ.get("BENCH_VALID_STEPS", "10"))

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
        NoOpModel(array_state=True),
        {"train": batches},
        plugins=plugins,
        max_epochs=EPOCHS,
        handle_signals=False,
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
            NoOpModel(array_state=True),
            data,
            plugins=plugins,
            max_epochs=EPOCHS,
            run_dir=tmp / "run",
            handle_signals=False,
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
