"""Memory and speed over a long run: is a run bounded by a window, not by its length?

A no-op model trains ``EPOCHS`` epochs of ``STEPS`` steps with the six standard plugins (monitor
with a record every step, early stopping, a checkpoint every epoch, the SQLite log, timing and
progress to /dev/null). At every epoch's first step the model notes the process's resident set
size (``/proc/self/statm``) and the previous epoch's wall time. Reported: RSS growth per 1,000 steps from
the end of the first ``WARM`` epochs to the end (a least-squares slope over the epochs after
the warm-up), and the median time of the last ``WARM`` epochs over that of the first ``WARM``
after the warm-up, in wall time and in the process's CPU time (wall time includes waiting for
fsyncs, whose latency on a shared disk drifts during a run; CPU time is the work per epoch).
Targets: ≤ 20 KB per 1,000 steps; ≤ 1.1×. The same run with the log's window
off (``EPOCHAL_LOG_WINDOW=0``: every row kept) is printed beside it for comparison.

    python bench/long_run.py [--epochs 200] [--steps 1000]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _common
import numpy as np

WARM = 10
PAGE = os.sysconf("SC_PAGE_SIZE")


def rss() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * PAGE


class NoOpModel(_common.NoOpModel):
    """A model whose step returns a constant; it notes RSS and time at each epoch's first step."""

    def __init__(self, steps: int) -> None:
        super().__init__(array_state=True)
        self.steps, self.count = steps, 0
        self.rss: list[int] = []
        self.times: list[float] = []
        self.cpu: list[float] = []
        self._start = time.perf_counter()
        self._cpu = time.process_time()

    def train_step(self, batch: Any) -> dict[str, float]:
        if self.count % self.steps == 0 and self.count:
            now, cpu = time.perf_counter(), time.process_time()
            self.times.append(now - self._start)
            self.cpu.append(cpu - self._cpu)
            self.rss.append(rss())
            self._start, self._cpu = now, cpu
        self.count += 1
        return {"loss": 0.0}


def child(epochs: int, steps: int, only: list[str]) -> None:
    import epochal

    options = {
        "monitor": {"every_n_batches": 1},
        "early_stopping": {"patience": 10**9},
        "checkpoint": {"every_n_epochs": 1, "keep_last": 2},
        "sqlite_log": {"flush_every": 10**9, "flush_seconds": 0.0},
        "timing": {"table": False},
        "progress": {"force": True, "mininterval": 0.1},
    }
    order = ["monitor", "early_stopping", "checkpoint", "sqlite_log", "timing", "progress"]
    order = [name for name in order if name in only] if only else order
    options = {name: value for name, value in options.items() if name in order}
    plugins = epochal.load_plugins(order=order, autoload=False, options=options)
    probe = NoOpModel(steps)
    with tempfile.TemporaryDirectory() as tmp, open(os.devnull, "w") as null:
        data = {"train": [np.zeros((1, 1), np.float32)] * steps}
        loop = epochal.Loop(
            probe,
            data,
            plugins=plugins,
            max_epochs=epochs + 1,
            run_dir=Path(tmp) / "run",
            handle_signals=False,
        )
        with contextlib.redirect_stderr(null), contextlib.redirect_stdout(null):
            loop.run()
    print(
        json.dumps(
            {
                "rss": probe.rss,
                "times": probe.times,
                "cpu": probe.cpu,
                "maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
            }
        )
    )


def measure(epochs: int, steps: int, window: str | None, only: str) -> dict[str, Any]:
    env = dict(os.environ)
    if window is not None:
        env["EPOCHAL_LOG_WINDOW"] = window
    out = subprocess.run(
        [sys.executable, __file__, "--child", "--epochs", str(epochs), "--steps", str(steps), "--only", only],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    data = json.loads(out.splitlines()[-1])
    rss_after, times, cpu = data["rss"][WARM:], data["times"][WARM:], data["cpu"][WARM:]
    x = np.arange(len(rss_after)) * steps / 1000  # thousands of steps
    slope = float(np.polyfit(x, np.array(rss_after) / 1024, 1)[0])  # KB per 1,000 steps
    first, last = statistics.median(times[:WARM]), statistics.median(times[-WARM:])
    return {
        "slope": slope,
        "ratio": last / first,
        "cpu_ratio": statistics.median(cpu[-WARM:]) / statistics.median(cpu[:WARM]),
        "cpu_first": statistics.median(cpu[:WARM]),
        "cpu_last": statistics.median(cpu[-WARM:]),
        "first": first,
        "last": last,
        "rss0": rss_after[0] / 2**20,
        "rss1": rss_after[-1] / 2**20,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=200)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--child", action="store_true")
    parser.add_argument("--only", default="", help="comma-separated plugins (default: the six)")
    parser.add_argument("--windows", default="default,off", help="default, off or both")
    args = parser.parse_args()
    if args.child:
        child(args.epochs, args.steps, [name for name in args.only.split(",") if name])
        return
    print(f"{args.epochs} epochs x {args.steps} steps, six standard plugins, a record every step")
    print(
        "| log window | RSS after warm-up → end (MB) | RSS growth, KB / 1,000 steps | epoch time last/first "
        "| epoch CPU time last/first |"
    )
    print("|---|---|---|---|---|")
    windows = {"default": ("default (1024 rows)", None), "off": ("off (every row kept)", "0")}
    for which in args.windows.split(","):
        label, window = windows[which]
        r = measure(args.epochs, args.steps, window, args.only)
        print(
            f"| {label} | {r['rss0']:.1f} → {r['rss1']:.1f} | {r['slope']:.1f} | {r['ratio']:.2f}× "
            f"({r['first'] * 1e3:.0f} → {r['last'] * 1e3:.0f} ms) | {r['cpu_ratio']:.2f}× "
            f"({r['cpu_first'] * 1e3:.1f} → {r['cpu_last'] * 1e3:.1f} ms) |"
        )


if __name__ == "__main__":
    main()
