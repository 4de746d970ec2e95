"""How often a 2-process run aborts at shutdown ("terminate called without an active exception").

Issue 31: about 1 run in 50-75 of ``epochal run --nproc 2`` ended with SIGABRT after training.
This script runs N short two-process runs (the tiny data-parallel regression of
``tests/ddp_tiny.py``, gloo over loopback, one epoch) one after another (or ``--jobs`` at a
time) and counts the runs that did not end cleanly, by who aborted:

- ``launcher``: the ``epochal`` process itself ended by a signal (SIGABRT: -6);
- ``worker``: the launcher reported a rank killed by a signal;
- ``terminate``: the text ``terminate called`` anywhere in the run's output.

    python bench/shutdown_abort.py [--runs 200] [--jobs 1] [--minutes 0 (no limit)]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from ddp_tiny import write_config  # tests/ddp_tiny.py: the run's model, data and configuration

PLUGINS = ["monitor", "checkpoint"]


def one_run(index: int, root: Path) -> dict[str, object]:
    """One two-process run in a fresh directory: its exit status and how it ended."""
    directory = root / f"run-{index:04d}"
    directory.mkdir()
    write_config(directory, PLUGINS, max_epochs=1, probe=False)
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPOCHAL_")}
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "epochal", "run", "run.toml", "--nproc", "2"],
        cwd=directory,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = done.stdout + done.stderr
    shutil.rmtree(directory, ignore_errors=True)
    return {
        "status": done.returncode,
        "seconds": time.perf_counter() - started,
        "launcher": done.returncode < 0,
        "worker": "was killed by" in output,
        "terminate": "terminate called" in output,
        "tail": output.strip().splitlines()[-3:] if done.returncode else [],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--minutes", type=float, default=0.0, help="stop starting runs after this long")
    args = parser.parse_args()
    deadline = time.monotonic() + args.minutes * 60 if args.minutes else float("inf")
    results: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory() as folder, ThreadPoolExecutor(args.jobs) as pool:
        root = Path(folder)

        def guarded(index: int) -> dict[str, object] | None:
            return one_run(index, root) if time.monotonic() < deadline else None

        for result in pool.map(guarded, range(args.runs)):
            if result is None:
                continue
            results.append(result)
            if result["status"] != 0:
                print(f"run {len(results)}: status {result['status']}: {result['tail']}", flush=True)
    runs = len(results)
    failed = [r for r in results if r["status"] != 0]
    seconds = sorted(float(r["seconds"]) for r in results)
    print(
        f"{runs} runs: {len(failed)} not clean; launcher ended by a signal: "
        f"{sum(bool(r['launcher']) for r in results)}; a worker killed by a signal: "
        f"{sum(bool(r['worker']) for r in results)}; 'terminate called' printed: "
        f"{sum(bool(r['terminate']) for r in results)}; median run {seconds[len(seconds) // 2]:.1f} s"
    )


if __name__ == "__main__":
    main()
