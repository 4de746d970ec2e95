"""Overhead of the timing and progress plugins, measured side by side in one run.

1. timing: the cost its wrapper adds to one hook call (a no-op implementation called directly
   vs through ``epochal_timing.make_timer``), and the cost per batch of a whole run of a no-op
   loop with 4 no-op plugins (before_batch + after_batch each) with and without ``timing``.
2. progress: a no-op-step loop (train_step returns {"loss": 0.0}) with and without ``progress``
   (force = true, bars drawn to /dev/null), against the issue's bound of 2x.
3. monitor: the same no-op-step loop (two float metrics per step) with ``monitor`` writing epoch
   records only (``every_n_batches = 0``), a running record every batch (1), every 2 batches and
   every 50 (the default). ``BENCH_BASE_MONITOR=path/to/plugin.py`` (another version's
   ``epochal_monitor/plugin.py``, e.g. from ``git show REV:plugins/...``) measures that version's
   ``Monitor`` in the same rounds, side by side.

Medians of interleaved repeats; prints a Markdown table. Run: ``python bench/plugin_overhead.py``
(``BENCH_ONLY=monitor`` runs the monitor's part alone).
"""

from __future__ import annotations

import contextlib
import gc
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from _common import NoOpModel
from epochal_progress import Progress
from epochal_timing import Timing, make_timer

from epochal import Loop, hookimpl

BATCHES = int(os.environ.get("BENCH_BATCHES", "20000"))
REPEATS = int(os.environ.get("BENCH_REPEATS", "9"))
ONLY = os.environ.get("BENCH_ONLY", "")
BASE_MONITOR = os.environ.get("BENCH_BASE_MONITOR", "")
SHORT = 1000  # batches per epoch of the short-epoch case (the per-bar fixed cost shows)


class TwoMetrics(NoOpModel):
    """A no-op model whose train step returns two host floats (the monitor's usual input)."""

    def __init__(self) -> None:
        super().__init__({"loss": 0.5, "accuracy": 0.25})


class NoOpPlugin:
    """A plugin with no-op batch hooks."""

    @hookimpl
    def before_batch(self, loop: Any, batch: Any) -> None:
        pass

    @hookimpl
    def after_batch(self, loop: Any, batch: Any, outputs: Any) -> None:
        pass


def per_batch_ns(
    make_plugins: Callable[[], dict[str, object]], batches: list[np.ndarray], model: type = NoOpModel
) -> float:
    """Nanoseconds per training batch of one epoch of a no-op loop with *make_plugins*()."""
    loop = Loop(model(), {"train": batches}, plugins=make_plugins(), max_epochs=1, handle_signals=False)
    gc.collect()
    gc.disable()
    try:
        start = time.perf_counter_ns()
        loop.run()
        elapsed = time.perf_counter_ns() - start
    finally:
        gc.enable()
    return elapsed / len(batches)


def compare(
    cases: dict[str, Callable[[], dict[str, object]]], batches: list[np.ndarray], model: type = NoOpModel
) -> dict[str, float]:
    """Median ns/batch of every case, repeats interleaved so drifts hit all cases alike."""
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(REPEATS):
        for name, make in cases.items():
            samples[name].append(per_batch_ns(make, batches, model))
    return {name: statistics.median(values) for name, values in samples.items()}


def wrapper_cost() -> tuple[float, float]:
    """Median ns per call of a no-op hook function called directly and through the timer."""

    def hook(loop: Any, batch: Any) -> None:
        pass

    timed = make_timer(hook, ("loop", "batch"), [0, 0])
    n = 200_000
    direct: list[float] = []
    wrapped: list[float] = []
    for _ in range(REPEATS):
        for fn, out in ((hook, direct), (timed, wrapped)):
            start = time.perf_counter_ns()
            for _ in range(n):
                fn(None, None)
            out.append((time.perf_counter_ns() - start) / n)
    return statistics.median(direct), statistics.median(wrapped)


def base_monitor() -> type | None:
    """The ``Monitor`` class of ``BENCH_BASE_MONITOR`` (another version's plugin.py), or None."""
    if not BASE_MONITOR:
        return None
    import importlib.util

    spec = importlib.util.spec_from_file_location("base_monitor_plugin", BASE_MONITOR)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.Monitor  # type: ignore[no-any-return]


def monitor_overhead(batches: list[np.ndarray]) -> None:
    """Print the monitor's cost per batch for each ``every_n_batches`` (and the base version's)."""
    from epochal_monitor import Monitor

    versions: dict[str, type] = {"this": Monitor}
    base = base_monitor()
    if base is not None:
        versions["base"] = base
    cases: dict[str, Callable[[], dict[str, object]]] = {"no plugins": lambda: {}}
    for version, cls in versions.items():
        for every in (0, 1, 2, 50):
            cases[f"{version} {every}"] = lambda cls=cls, every=every: {"monitor": cls(every_n_batches=every)}
    result = compare(cases, batches, TwoMetrics)
    floor = result["no plugins"]
    print("## monitor: no-op-step loop (two float metrics), per batch\n")
    print(f"Loop with no plugins: {floor:.0f} ns/batch. Added by monitor (ns/batch) and its ratio to epoch")
    print("records only (every_n_batches = 0) of the same version:\n")
    head = " | ".join(f"{v} ns | {v} / {v} 0" for v in versions)
    print(f"| every_n_batches | {head} |")
    print("|---|" + "---:|---:|" * len(versions))
    for every in (0, 1, 2, 50):
        cells = []
        for version in versions:
            added = result[f"{version} {every}"] - floor
            cells.append(f"{added:.0f} | {added / (result[f'{version} 0'] - floor):.2f}")
        print(f"| {every}{' (default)' if every == 50 else ''} | {' | '.join(cells)} |")
    if base is not None:
        print(
            "\nthis / base, added ns per batch: "
            + ", ".join(
                f"{every}: {(result[f'this {every}'] - floor) / (result[f'base {every}'] - floor):.2f}"
                for every in (0, 1, 2, 50)
            )
        )
    print()


def main() -> None:
    """Run the benchmarks and print the figures."""
    batches = [np.zeros(1, np.float32) for _ in range(BATCHES)]
    print(f"# plugin overhead (CPython {sys.version.split()[0]}, {BATCHES} batches, median of {REPEATS})\n")
    if ONLY == "monitor":
        monitor_overhead(batches)
        return

    direct, wrapped = wrapper_cost()
    print("## timing: wrapper cost per hook call\n")
    print("| call | ns/call |\n|---|---:|")
    print(f"| no-op hook function, direct | {direct:.0f} |")
    print(f"| same through timing's wrapper | {wrapped:.0f} |")
    print(f"| **added per hook call** | **{wrapped - direct:.0f}** |\n")

    k = 4
    cases: dict[str, Callable[[], dict[str, object]]] = {
        "4 no-op plugins": lambda: {f"p{i}": NoOpPlugin() for i in range(k)},
        "4 no-op plugins + timing": lambda: {
            **{f"p{i}": NoOpPlugin() for i in range(k)},
            "timing": Timing(table=False),
        },
    }
    result = compare(cases, batches)
    base, timed = result["4 no-op plugins"], result["4 no-op plugins + timing"]
    calls = 2 * k + 2  # the wrapped calls plus timing's own two batch hooks
    print("## timing: whole loop, per batch (2 x 4 wrapped hook calls + timing's 2 hooks)\n")
    print("| loop | ns/batch | ratio |\n|---|---:|---:|")
    print(f"| 4 no-op plugins | {base:.0f} | 1.00 |")
    print(f"| 4 no-op plugins + timing | {timed:.0f} | {timed / base:.2f} |")
    print(f"| **added per hook call** ((with - without) / {calls}) | **{(timed - base) / calls:.0f}** | |\n")

    with open(os.devnull, "w") as devnull, contextlib.redirect_stderr(devnull):
        result = compare(
            {
                "no plugins": lambda: {},
                "progress (force, default mininterval)": lambda: {"progress": Progress(force=True)},
                "progress, metrics = [] (no running means)": lambda: {
                    "progress": Progress(force=True, metrics=[])
                },
            },
            batches,
        )
        short = compare(
            {
                "no plugins": lambda: {},
                "progress (force, default mininterval)": lambda: {"progress": Progress(force=True)},
            },
            batches[:SHORT],
        )
        bare_loop, bare_tqdm = tqdm_reference(batches)
    base, bars = result["no plugins"], result["progress (force, default mininterval)"]
    print("## progress: no-op-step loop, per batch\n")
    print("| loop | ns/batch | ratio |\n|---|---:|---:|")
    print(f"| Loop, no-op step, no plugins | {base:.0f} | 1.00 |")
    print(f"| same + progress (bars to /dev/null) | {bars:.0f} | **{bars / base:.2f}** (bound: 2.00) |")
    means = result["progress, metrics = [] (no running means)"]
    print(f"| same + progress, `metrics = []` (no running means) | {means:.0f} | {means / base:.2f} |")
    short_base, short_bars = short["no plugins"], short["progress (force, default mininterval)"]
    print(f"| {SHORT}-batch epochs: no plugins | {short_base:.0f} | 1.00 |")
    print(
        f"| {SHORT}-batch epochs: + progress (the fixed cost of a bar shows) "
        f"| {short_bars:.0f} | {short_bars / short_base:.2f} |"
    )
    print(f"| reference: bare `for` over the list | {bare_loop:.0f} | |")
    print(f"| reference: bare `for` over `tqdm(list)` | {bare_tqdm:.0f} | |\n")
    monitor_overhead(batches)


def tqdm_reference(batches: list[np.ndarray]) -> tuple[float, float]:
    """Median ns per item of a bare for loop, and of the same loop over tqdm (to /dev/null)."""
    from tqdm import tqdm

    plain: list[float] = []
    bar: list[float] = []
    for _ in range(REPEATS):
        start = time.perf_counter_ns()
        for _batch in batches:
            pass
        plain.append((time.perf_counter_ns() - start) / len(batches))
        start = time.perf_counter_ns()
        for _batch in tqdm(batches, file=sys.stderr):
            pass
        bar.append((time.perf_counter_ns() - start) / len(batches))
    return statistics.median(plain), statistics.median(bar)


if __name__ == "__main__":
    main()
