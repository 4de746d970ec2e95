"""What importing epochal costs on top of its floors, in process CPU time (issue 48).

Each command runs in a fresh interpreter (bytecode cached in a temp ``PYTHONPYCACHEPREFIX``
after one warm-up run, as a user of installed packages has it); its CPU time is the children's
user + system time around it (``resource.getrusage``), so another process's load on a shared
machine adds less than to wall time. Commands run interleaved, the order rotating each round;
printed per command: the median CPU time and wall time, then the ratios of the medians:

* ``import epochal.torch`` / ``import torch`` (goal ≤ 1.05×: DCP and DTensor are imported only
  when FSDP or a sharded checkpoint is used);
* ``epochal --help`` / ``import pluggy, stevedore`` (goal ≤ 1.5×).

    python bench/import_cost.py [--rounds 15]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

COMMANDS = {
    "import torch": [sys.executable, "-c", "import torch"],
    "import epochal.torch": [sys.executable, "-c", "import epochal.torch"],
    "import pluggy, stevedore": [sys.executable, "-c", "import pluggy, stevedore"],
    "epochal --help": [sys.executable, "-m", "epochal", "--help"],
}
RATIOS = [("import epochal.torch", "import torch", 1.05), ("epochal --help", "import pluggy, stevedore", 1.5)]


def timed(command: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(CPU seconds, wall seconds) of one run of *command*."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return cpu, wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as cache:
        env = {k: v for k, v in os.environ.items() if not k.startswith("EPOCHAL_")}
        env.update(PYTHONPYCACHEPREFIX=cache, XDG_CACHE_HOME=cache)
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        names = list(COMMANDS)
        for name in names:  # warm-up: bytecode written, the plugin listing cached
            timed(COMMANDS[name], env)
        cpu: dict[str, list[float]] = {n: [] for n in names}
        wall: dict[str, list[float]] = {n: [] for n in names}
        for round_ in range(args.rounds):
            shift = round_ % len(names)
            for name in names[shift:] + names[:shift]:
                c, w = timed(COMMANDS[name], env)
                cpu[name].append(c)
                wall[name].append(w)
    print(f"| command | CPU, median of {args.rounds} | wall, median |")
    print("|---|---:|---:|")
    for name in names:
        print(f"| `{name}` | {statistics.median(cpu[name]):.3f} s | {statistics.median(wall[name]):.3f} s |")
    print()
    print("| ratio | goal | CPU | wall |")
    print("|---|---:|---:|---:|")
    for top, floor, goal in RATIOS:
        by_cpu = statistics.median(cpu[top]) / statistics.median(cpu[floor])
        by_wall = statistics.median(wall[top]) / statistics.median(wall[floor])
        print(f"| `{top}` / `{floor}` | ≤ {goal}× | {by_cpu:.2f}× | {by_wall:.2f}× |")


if __name__ == "__main__":
    main()
