"""Start-up time of ``epochal plugins`` against the floor of importing its two building blocks.

What is measured: the wall time of a subprocess (start to exit, output to /dev/null) of

* ``epochal plugins``: the console script installed next to this Python (not a shell shim),
  listing every installed plugin; after the warm-up run its listing cache (in a temp
  ``XDG_CACHE_HOME``) holds the listing, so it imports no plugin: what a user gets from the
  second call on, until a plugin is installed, removed or edited;
* ``epochal plugins --no-cache``: the same listing built afresh, which imports and instantiates
  every plugin (the first call, or any call after an install);
* ``python -c "import pluggy, stevedore"``: the floor the issue compares it with;
* ``python -c pass``: the interpreter's own start, for reference.

Each is timed twice per round: with bytecode cached in a temp ``PYTHONPYCACHEPREFIX`` (what a user
of installed packages gets; the headline), and in the environment as it is (a development
environment with ``PYTHONDONTWRITEBYTECODE=1`` and epochal installed editable compiles every
epochal and plugin module from source at every start, while site-packages has its ``.pyc``).

The commands run interleaved ``REPEATS`` times (``BENCH_REPEATS``, default 15) after one warm-up
each; the medians and the ratio ``epochal plugins / import pluggy, stevedore`` are printed as
Markdown (target: at most 1.5×, issue 13). Then ``python -X importtime`` runs both ``IMPORTTIME_RUNS`` times
(bytecode cached) and the median self and cumulative import times are printed for the slowest
modules and summed per top-level package, side by side, to show which imports dominate.
Run: ``python bench/startup.py``.
"""

from __future__ import annotations

import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

REPEATS = int(os.environ.get("BENCH_REPEATS", "15"))
IMPORTTIME_RUNS = int(os.environ.get("BENCH_IMPORTTIME_RUNS", "5"))
TARGET = 1.5


def epochal_script() -> list[str]:
    """The ``epochal`` console script of this Python (a pyenv shim would add a bash start)."""
    script = Path(sys.executable).parent / "epochal"
    if script.exists():
        return [str(script)]
    found = shutil.which("epochal")
    return [found] if found else [sys.executable, "-m", "epochal"]


COMMANDS: dict[str, list[str]] = {
    "epochal plugins": [*epochal_script(), "plugins"],
    "epochal plugins --no-cache": [*epochal_script(), "plugins", "--no-cache"],
    "python -c 'import pluggy, stevedore'": [sys.executable, "-c", "import pluggy, stevedore"],
    "python -c pass": [sys.executable, "-c", "pass"],
}


def environment(pycache: str | None, cache: str) -> dict[str, str]:
    """The environment of the commands: with *pycache*, bytecode is cached under that folder
    (``PYTHONPYCACHEPREFIX``, so nothing is written next to the sources) even when this
    environment sets ``PYTHONDONTWRITEBYTECODE``; without, the environment as it is. epochal's
    listing cache lives in *cache* (``XDG_CACHE_HOME``), never switched off by ``EPOCHAL_*``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPOCHAL_")}
    env["XDG_CACHE_HOME"] = cache
    if pycache is not None:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = pycache
    return env


def run_once(command: list[str], cwd: str, env: dict[str, str]) -> float:
    """Wall seconds of one run of *command* (stdout/stderr to devnull); it must exit 0."""
    start = time.perf_counter()
    subprocess.run(
        command, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True
    )
    return time.perf_counter() - start


def importtime(
    cwd: str, env: dict[str, str], args: list[str]
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Per module: self µs and cumulative µs of every ``python -X importtime ARGS`` run."""
    own: dict[str, list[float]] = defaultdict(list)
    cumulative: dict[str, list[float]] = defaultdict(list)
    for _ in range(IMPORTTIME_RUNS):
        done = subprocess.run(
            [sys.executable, "-X", "importtime", *args],
            cwd=cwd,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            check=True,
        )
        for line in done.stderr.splitlines():
            if not line.startswith("import time:") or "self [us]" in line:
                continue
            self_us, cumulative_us, name = line.removeprefix("import time:").split("|")
            own[name.strip()].append(float(self_us))
            cumulative[name.strip()].append(float(cumulative_us))
    return own, cumulative


def by_package(own: dict[str, float]) -> dict[str, float]:
    """Self ms summed per top-level package."""
    packages: dict[str, float] = defaultdict(float)
    for name, value in own.items():
        packages[name.split(".")[0]] += value / 1e3
    return packages


def main() -> None:
    """Time the commands, print the Markdown tables."""
    with (
        tempfile.TemporaryDirectory() as cwd,
        tempfile.TemporaryDirectory() as pycache,
        tempfile.TemporaryDirectory() as cache,
    ):
        cached, as_is = environment(pycache, cache), environment(None, cache)
        for command in COMMANDS.values():  # the warm-up also fills the listing cache
            run_once(command, cwd, cached)
        samples: dict[str, list[float]] = {name: [] for name in COMMANDS}
        raw: dict[str, list[float]] = {name: [] for name in COMMANDS}
        for _ in range(REPEATS):
            for name, command in COMMANDS.items():
                samples[name].append(run_once(command, cwd, cached) * 1e3)
                raw[name].append(run_once(command, cwd, as_is) * 1e3)
        run_once([sys.executable, "-m", "epochal", "plugins"], cwd, cached)  # -m: its own cache key
        own, cumulative = importtime(cwd, cached, ["-m", "epochal", "plugins"])
        fresh_own, fresh_cumulative = importtime(cwd, cached, ["-m", "epochal", "plugins", "--no-cache"])
        floor_own, _ = importtime(cwd, cached, ["-c", "import pluggy, stevedore"])

    print(
        f"median of {REPEATS} interleaved runs; {time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores, "
        f"CPython {platform.python_version()}"
    )
    dont_write = os.environ.get("PYTHONDONTWRITEBYTECODE")
    for title, table in (
        ("bytecode cached (as for an installed package)", samples),
        (f"environment as is (PYTHONDONTWRITEBYTECODE={dont_write or 'unset'})", raw),
    ):
        median = {name: statistics.median(values) for name, values in table.items()}
        floor = median["python -c 'import pluggy, stevedore'"]
        print()
        print(f"{title}:")
        print()
        print("| command | median ms | min–max ms | × import pluggy, stevedore |")
        print("|---|---:|---:|---:|")
        for name, value in median.items():
            spread = f"{min(table[name]):.0f}–{max(table[name]):.0f}"
            print(f"| `{name}` | {value:.0f} | {spread} | {value / floor:.2f}× |")
        print()
        for name in ("epochal plugins", "epochal plugins --no-cache"):
            ratio = median[name] / floor
            verdict = "met" if ratio <= TARGET else "missed"
            print(f"Target `{name}` ≤ {TARGET:g}× `import pluggy, stevedore`: {verdict} ({ratio:.2f}×).")

    def medians(samples: dict[str, list[float]]) -> dict[str, float]:
        return {name: statistics.median(values) for name, values in samples.items()}

    packages, fresh, floor_packages = (
        by_package(medians(own)),
        by_package(medians(fresh_own)),
        by_package(medians(floor_own)),
    )
    print()
    print(
        f"`python -X importtime` (median of {IMPORTTIME_RUNS} runs; importtime itself slows imports), "
        "self time summed per top-level package, `epochal plugins` (a cache hit) and `--no-cache` "
        "against `import pluggy, stevedore`:"
    )
    print()
    print("| package | epochal plugins ms | --no-cache ms | import pluggy, stevedore ms |")
    print("|---|---:|---:|---:|")
    names = sorted(
        set(packages) | set(fresh) | set(floor_packages),
        key=lambda n: -max(packages.get(n, 0.0), fresh.get(n, 0.0), floor_packages.get(n, 0.0)),
    )
    for name in names[:20]:
        values = (table.get(name, 0.0) for table in (packages, fresh, floor_packages))
        print(f"| {name} | " + " | ".join(f"{value:.1f}" for value in values) + " |")
    totals = [sum(p.values()) for p in (packages, fresh, floor_packages)]
    print(f"| (all imports) | {totals[0]:.1f} | {totals[1]:.1f} | {totals[2]:.1f} |")
    for title, own_median, cumulative_median in (
        ("`epochal plugins`", medians(own), medians(cumulative)),
        ("`epochal plugins --no-cache`", medians(fresh_own), medians(fresh_cumulative)),
    ):
        print()
        print(f"Slowest modules by self time, {title}:")
        print()
        print("| module | self ms | cumulative ms |")
        print("|---|---:|---:|")
        for name, value in sorted(own_median.items(), key=lambda item: -item[1])[:12]:
            print(f"| {name} | {value / 1e3:.1f} | {cumulative_median[name] / 1e3:.1f} |")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
