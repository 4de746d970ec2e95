"""What each of the six standard plugins adds to the others: ``bench/peers.py``'s epochal case
with one plugin left out at a time, side by side.

``bench/peers.py`` measures each plugin alone; alone, a plugin misses what it costs in company
(``timing`` times every other plugin's hooks, so its share grows with them). Here every case
runs the features of ``peers.py`` (epoch records only unless ``--step-records``) with all six
plugins, or five of them, or none; the rounds are interleaved and the medians printed in µs per
training step, wall and CPU, with the difference to all six. Run:
``python bench/leave_one_out.py [--rounds N] [--step-records]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

import peers  # beside this file


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=peers.rounds, default=7)
    parser.add_argument("--step-records", action="store_true", help="monitor writes a record every step")
    args = parser.parse_args()
    cases: dict[str, Any] = {"all six": peers.make_epochal_features(args.step_records)}
    for plugin in peers.EPOCHAL_ORDER:
        cases[f"without {plugin}"] = peers.make_epochal_features(args.step_records, without=plugin)
    cases["none (loop + validation)"] = peers.make_epochal_features(args.step_records, only="")
    steps = peers.EPOCHS * peers.STEPS
    for setup in cases.values():  # warm-up
        peers.time_run(setup)
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in cases}
    for _ in range(args.rounds):
        for name, setup in cases.items():
            wall, cpu = peers.time_run(setup)
            samples[name].append((wall / steps * 1e6, cpu / steps * 1e6))
    wall_all = statistics.median(w for w, _ in samples["all six"])
    cpu_all = statistics.median(c for _, c in samples["all six"])
    records = "a record every step" if args.step_records else "epoch records"
    sizes = f"{peers.EPOCHS} epochs × {peers.STEPS} steps"
    print(f"{sizes}, {records}, medians of {args.rounds} interleaved rounds")
    print()
    print("| case | wall µs/step | vs all six | CPU µs/step | vs all six |")
    print("|---|---:|---:|---:|---:|")
    for name, values in samples.items():
        wall = statistics.median(w for w, _ in values)
        cpu = statistics.median(c for _, c in values)
        print(f"| {name} | {wall:.2f} | {wall - wall_all:+.2f} | {cpu:.2f} | {cpu - cpu_all:+.2f} |")


if __name__ == "__main__":
    main()
