"""Per-step cost of the shared trigger keys (``every_n_batches`` & co., gated in the core).

Compared in one run, with 6 no-op plugins implementing ``before_batch`` and ``after_batch``:

- ``no feature``: the hook callers compiled with no gate at all (the code before triggers);
- ``no triggers``: the callers as a run compiles them now, no plugin having a trigger key
  (must equal ``no feature``: plugins without trigger keys pay nothing);
- ``1 triggered``: one of the six with ``every_n_batches = 1`` (its gate is called every step);
- ``6 triggered``: all six with ``every_n_batches = 1``.

    python bench/trigger_overhead.py [--steps 20000] [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

from loop_overhead import NoOp, NoOpModel

from epochal import Loop, compose
from epochal.triggers import Triggers

K = 6


def make(variant: str, batches: list) -> Callable[[], None]:
    def run() -> None:
        plugin_set = compose({f"p{i}": NoOp() for i in range(K)})
        triggered = {"1 triggered": 1, "6 triggered": K}.get(variant, 0)
        plugin_set.triggers = {f"p{i}": Triggers(every_n_batches=1) for i in range(triggered)}
        if variant == "no feature":
            plugin_set.hooks._gate = None
        plugin_set.hooks.rebuild()
        Loop(NoOpModel(), {"train": batches}, plugins=plugin_set, max_epochs=1, handle_signals=False).run()

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    batches = [(0, 0)] * args.steps
    variants = ("no feature", "no triggers", "1 triggered", "6 triggered")
    runs = {v: make(v, batches) for v in variants}
    for run in runs.values():
        run()  # warm up
    times: dict[str, list[float]] = {v: [] for v in variants}
    for _ in range(args.repeats):  # interleaved, so that machine noise hits every variant alike
        for variant, run in runs.items():
            start = time.perf_counter()
            run()
            times[variant].append(time.perf_counter() - start)
    base = statistics.median(times["no feature"])
    print(f"{K} plugins, per-step time, median of {args.repeats} interleaved runs of {args.steps} steps")
    for variant in variants:
        median = statistics.median(times[variant])
        print(f"{variant:>12}: {median / args.steps * 1e9:7.0f} ns/step  {median / base:5.2f}x no feature")


if __name__ == "__main__":
    main()
