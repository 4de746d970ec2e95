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

import gc
import logging
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

from _common import quiet, rounds, version
from peers_setups import (
    EPOCHAL_ORDER,
    EPOCHS,
    STEPS,
    VALID_STEPS,
    Setup,
    bare_python,
    epochal_bare,
    ignite_bare,
    lightning_bare,
    lightning_features,
    make_epochal_features,
    make_ignite_features,
)

#: what the other bench scripts use as ``peers.NAME``.
__all__ = [
    "EPOCHAL_ORDER",
    "EPOCHS",
    "STEPS",
    "VALID_STEPS",
    "Setup",
    "bare_python",
    "cases",
    "make_epochal_features",
    "make_ignite_features",
    "quiet",
    "rounds",
    "silence_peers",
    "time_run",
    "version",
]

REPEATS = int(os.environ.get("BENCH_REPEATS", "7"))
ONLY = {name for name in os.environ.get("BENCH_ONLY", "").split(",") if name}


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
