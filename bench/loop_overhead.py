"""Per-step overhead of the epochal loop with 0, 1, 6 and 20 no-op plugins.

Compared in one run against a bare Python loop that calls the same no-op callbacks directly
(`before_batch` and `after_batch` of every plugin, each step), and against pluggy's own
dispatch (`pm.hook.before_batch(...)`) for reference. Every figure is the median of several
repeats of a whole run, divided by the number of steps. Target: epochal ≤ 3× direct at 6.

Then, for each batch type (a tuple of arrays, an array, a dict of arrays, an object without
``len``), epochal with 0 and 6 plugins against the direct calls over the same batches: the loop's
own per-batch work (``batch_size``, counters) must not depend on the batch type. Target ≤ 3×.

    python bench/loop_overhead.py [--steps 20000] [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np

from epochal import Loop, hookimpl
from epochal.plugins import new_plugin_manager

OUTPUTS = {"loss": 0.0}


class NoOpModel:
    def train_step(self, batch: object) -> dict[str, float]:
        return OUTPUTS

    def eval_step(self, batch: object) -> dict[str, float]:
        return OUTPUTS

    def state_dict(self) -> dict[str, object]:
        return {}

    def load_state_dict(self, state: object) -> None:
        pass


class Opaque:
    """A batch without ``len`` (a custom batch object)."""

    def __init__(self, x: np.ndarray) -> None:
        self.x = x


class NoOp:
    @hookimpl
    def before_batch(self, loop: object, batch: object) -> None:
        pass

    @hookimpl
    def after_batch(self, loop: object, batch: object, outputs: object) -> None:
        pass


def bare(batches: list, k: int) -> Callable[[], None]:
    step = NoOpModel().train_step

    def run() -> None:
        for batch in batches:
            step(batch)

    return run


def direct(batches: list, k: int) -> Callable[[], None]:
    step = NoOpModel().train_step
    plugins = [NoOp() for _ in range(k)]
    befores = [p.before_batch for p in plugins]
    afters = [p.after_batch for p in plugins]
    loop = object()

    def run() -> None:
        for batch in batches:
            for before in befores:
                before(loop, batch)
            outputs = step(batch)
            for after in afters:
                after(loop, batch, outputs)

    return run


def pluggy_dispatch(batches: list, k: int) -> Callable[[], None]:
    pm = new_plugin_manager()
    for i in range(k):
        pm.register(NoOp(), name=f"p{i}")
    step = NoOpModel().train_step
    before, after = pm.hook.before_batch, pm.hook.after_batch
    loop = object()

    def run() -> None:
        for batch in batches:
            before(loop=loop, batch=batch)
            outputs = step(batch)
            after(loop=loop, batch=batch, outputs=outputs)

    return run


def epochal_loop(batches: list, k: int) -> Callable[[], None]:
    def run() -> None:
        plugins = {f"p{i}": NoOp() for i in range(k)}
        Loop(NoOpModel(), {"train": batches}, plugins=plugins, max_epochs=1, handle_signals=False).run()

    return run


def median_per_step(
    make: Callable[[list, int], Callable[[], None]], batches: list, k: int, repeats: int
) -> float:
    run = make(batches, k)
    run()  # warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times) / len(batches)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    x, y = np.zeros((32, 4), dtype=np.float32), np.zeros(32, dtype=np.int64)
    batches = [(x, y)] * args.steps
    print(f"per-step time, median of {args.repeats} runs of {args.steps} steps (2 hook calls per step)")
    print(
        f"{'plugins':>7} {'bare':>9} {'direct':>9} {'epochal':>9} {'pluggy':>9} "
        f"{'epochal/direct':>15} {'pluggy/direct':>14}"
    )
    bare_ns = median_per_step(bare, batches, 0, args.repeats) * 1e9
    for k in (0, 1, 6, 20):
        d = median_per_step(direct, batches, k, args.repeats) * 1e9
        e = median_per_step(epochal_loop, batches, k, args.repeats) * 1e9
        p = median_per_step(pluggy_dispatch, batches, k, args.repeats) * 1e9
        print(f"{k:>7} {bare_ns:>7.0f}ns {d:>7.0f}ns {e:>7.0f}ns {p:>7.0f}ns {e / d:>14.2f}x {p / d:>13.2f}x")
    kinds = {"tuple": (x, y), "array": x, "dict": {"x": x, "y": y}, "no len": Opaque(x)}
    # Interleaved rounds: every (type, plugins, variant) once per round, so that the load of a
    # shared machine hits them alike; medians over the rounds, and the median of the per-round
    # ratios epochal/direct.
    runs = {
        (name, k, variant): make([batch] * args.steps, k)
        for name, batch in kinds.items()
        for k in (0, 6)
        for variant, make in (("direct", direct), ("epochal", epochal_loop))
    }
    for run in runs.values():
        run()  # warm up
    samples: dict[tuple[str, int, str], list[float]] = {key: [] for key in runs}
    for _ in range(args.repeats):
        for key, run in runs.items():
            start = time.perf_counter()
            run()
            samples[key].append((time.perf_counter() - start) / args.steps * 1e9)
    print(
        f"\nby batch type, {args.repeats} interleaved rounds: {'type':>8} {'plugins':>7} {'direct':>9} "
        f"{'epochal':>9} {'epochal/direct':>15} {'ratio min-max':>14} {'best/best':>10}"
    )
    for name in kinds:
        for k in (0, 6):
            d, e = samples[(name, k, "direct")], samples[(name, k, "epochal")]
            ratios = [b / a for a, b in zip(d, e)]
            print(
                f"{'':>36} {name:>8} {k:>7} {statistics.median(d):>7.0f}ns {statistics.median(e):>7.0f}ns "
                f"{statistics.median(ratios):>14.2f}x {min(ratios):>6.2f}-{max(ratios):.2f}x "
                f"{min(e) / min(d):>9.2f}x"  # the least disturbed round of each: a noisy machine
            )


if __name__ == "__main__":
    main()
