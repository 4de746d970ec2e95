"""``bench/peers.py``'s epochal and Ignite cases at two epoch lengths, side by side: what each
framework costs per training step, and what it costs per run whatever the number of steps.

``bench/peers.py`` divides a whole run's time by its steps, so what a run pays once (opening
its log, its start and end) or once per epoch (a checkpoint, the epoch's records, the
validation) is spread over the steps of its five epochs: its figure depends on the epoch
length it is given. Here the same runs (five epochs, the same validation) are timed with
``STEPS`` and with ``--factor`` × ``STEPS`` steps per epoch, in interleaved rounds, and each
case's median time *t(n)* at *n* training steps is split into a line through the two points:

* per step: ``(t(n_long) − t(n_short)) / (n_long − n_short)``, the marginal cost of a step (the
  loop's and the handlers' per-batch work);
* per run: ``t(n_short) − n_short × per step``, the cost of the five epochs that does not grow
  with their length (start, end, the per-epoch work).

The overheads are these minus the bare Python loop's, and the ratios Ignite / epochal of each.
Run: ``python bench/epoch_length.py [--rounds N] [--factor K]`` (``BENCH_STEPS`` sets the short
epoch, as for peers.py; needs ``pip install -r bench/requirements-peers.txt``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import peers  # beside this file
import peers_setups

CASES = {
    "bare python": peers.bare_python,
    "epochal + features": peers.make_epochal_features(step_records=True),
    "epochal + features (epoch records)": peers.make_epochal_features(step_records=False),
    "ignite + features": peers.make_ignite_features("0.1s"),
    "ignite + features (epoch records)": peers.make_ignite_features("0.1s", step_records=False),
    "ignite + features, durable checkpoint": peers.make_ignite_features("0.1s", durable=True),
    "ignite + features (epoch records), durable checkpoint": peers.make_ignite_features(
        "0.1s", step_records=False, durable=True
    ),
}
#: (level, epochal's case, Ignite's case)
LEVELS = [
    ("a record every step", "epochal + features", "ignite + features"),
    ("epoch records only", "epochal + features (epoch records)", "ignite + features (epoch records)"),
    (
        "a record every step, Ignite's checkpoint fsynced",
        "epochal + features",
        "ignite + features, durable checkpoint",
    ),
    (
        "epoch records only, Ignite's checkpoint fsynced",
        "epochal + features (epoch records)",
        "ignite + features (epoch records), durable checkpoint",
    ),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=peers.rounds, default=5)
    parser.add_argument("--factor", type=int, default=10, help="the long epoch is this many short ones")
    args = parser.parse_args()
    if args.factor < 2:
        parser.error(f"--factor must be at least 2, got {args.factor}")
    peers.silence_peers()
    short = peers_setups.STEPS
    sizes = (short, short * args.factor)
    samples: dict[tuple[str, int], list[float]] = {(name, n): [] for name in CASES for n in sizes}
    for round_ in range(args.rounds + 1):  # round 0 warms up (imports, first-run caches)
        for name, setup in CASES.items():
            for n in sizes:
                peers_setups.STEPS = n  # the setups read it when they build a run
                wall, _cpu = peers.time_run(setup)
                if round_:
                    samples[name, n].append(wall)
    peers_setups.STEPS = short
    median = {key: statistics.median(values) for key, values in samples.items()}
    n_short, n_long = (peers.EPOCHS * n for n in sizes)
    span = n_long - n_short
    per_step = {name: (median[name, sizes[1]] - median[name, sizes[0]]) / span for name in CASES}
    per_run = {name: median[name, sizes[0]] - n_short * per_step[name] for name in CASES}

    print(
        f"{peers.EPOCHS} epochs of {sizes[0]:,} and of {sizes[1]:,} steps (+ {peers.VALID_STEPS} validation "
        f"batches per epoch), medians of {args.rounds} interleaved rounds, wall time"
    )
    print()
    print(f"| case | µs/step at {sizes[0]:,} | µs/step at {sizes[1]:,} | per step µs | per run ms |")
    print("|---|---:|---:|---:|---:|")
    for name in CASES:
        short_us, long_us = median[name, sizes[0]] / n_short * 1e6, median[name, sizes[1]] / n_long * 1e6
        step_us, run_ms = per_step[name] * 1e6, per_run[name] * 1e3
        print(f"| {name} | {short_us:.2f} | {long_us:.2f} | {step_us:.2f} | {run_ms:.2f} |")
    print()
    print("Overheads (minus the bare Python loop's) and Ignite / epochal:")
    print()
    head = f"at {sizes[0]:,} steps/epoch (peers.py) | at {sizes[1]:,}"
    print(f"| level | {head} | per step (marginal) | per run |")
    print("|---|---:|---:|---:|---:|")
    floor = "bare python"
    for level, ours, theirs in LEVELS:
        cells = []
        for n, steps in zip(sizes, (n_short, n_long)):
            mine = (median[ours, n] - median[floor, n]) / steps * 1e6
            peer = (median[theirs, n] - median[floor, n]) / steps * 1e6
            cells.append(f"{mine:.2f} / {peer:.2f} µs = **{peer / mine:.2f}×**")
        mine = (per_step[ours] - per_step[floor]) * 1e6
        peer = (per_step[theirs] - per_step[floor]) * 1e6
        cells.append(f"{mine:.2f} / {peer:.2f} µs = **{peer / mine:.2f}×**")
        mine = (per_run[ours] - per_run[floor]) * 1e3
        peer = (per_run[theirs] - per_run[floor]) * 1e3
        cells.append(f"{mine:.1f} / {peer:.1f} ms = {peer / mine:.2f}×")
        print(f"| {level} | {' | '.join(cells)} |")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
