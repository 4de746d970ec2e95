"""Benchmark: the mlflow plugin's end-of-run drain of 100,000 records to a local tracking server.

The path a user runs: an epochal ``Loop`` with the ``mlflow`` plugin (defaults, but
``tracking_uri`` = a local ``mlflow server``), a no-op model whose batches give 10 records, 10,000
batches in one epoch. The loop outruns any tracker, so when training ends nearly all 100,000
records wait in the plugin's buffer; the figure is the plugin's ``after_training``: sending
what is left, logging the config, ending the MLflow run (what ``bench/loggers.py`` calls *end*).
The first batch waits until the plugin's thread has created its MLflow run, so that start-up
is not in the figure. Each round checks that every record reached the server.

Also measured per round: the CPU seconds of the plugin's process over the drain (its sending
threads: building and encoding the requests) and the server's CPU seconds over the whole round
(its process group, from ``/proc``): the server's work per record is a floor no client goes under.

``--before REV`` also runs the plugin as it was at git revision REV (its sources extracted to a
temporary directory, put first on ``PYTHONPATH``), alternating with the current one: each round
runs in a fresh process, before and after interleaved, against the same server. ``--workers``
lists the server configurations (uvicorn worker processes; ``mlflow server``'s default is 4).

Usage: ``python bench/mlflow_drain.py [--records N] [--rounds R] [--workers 1 4] [--before REV]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from _common import rounds, version  # beside this file
from epochal_mlflow.testing import Server

ROOT = Path(__file__).resolve().parent.parent
KEYS = [f"train.metric{j}" for j in range(10)]


# -- one round, in its own process -------------------------------------------------------------


def one_round(uri: str, records: int) -> dict[str, Any]:
    """Run the loop with the plugin against *uri*; the drain's seconds and the records that arrived."""
    import logging
    import warnings

    from _common import NoOpModel
    from epochal_mlflow import MLflow
    from mlflow import MlflowClient

    from epochal import Loop, hookimpl

    logging.getLogger("mlflow").setLevel(logging.WARNING)
    warnings.simplefilter("ignore")
    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")

    class Records:
        """Writes the batch's records; at the first batch, waits for the plugin's MLflow run."""

        @hookimpl
        def after_batch(self, loop: Any, outputs: Mapping[str, Any]) -> None:
            row = loop.log.current_row
            for key, value in outputs.items():
                row[key] = value + loop.iteration
            if loop.iteration == 1:
                tracker = loop.plugins["mlflow"].tracker
                while tracker.mlflow_run_id is None:
                    time.sleep(0.01)

    class Clock:
        """Listed before the mlflow plugin: its ``after_training`` runs just before the plugin's."""

        start = cpu = 0.0

        @hookimpl
        def after_training(self) -> None:
            self.start, self.cpu = time.perf_counter(), time.process_time()

    # Room for every record (the default bound, 100,000, would drop the oldest of a backlog).
    plugin = MLflow(uri, experiment="drain", close_timeout=600, max_buffered=2 * records)
    clock = Clock()
    batches = records // len(KEYS)
    with tempfile.TemporaryDirectory() as tmp:
        loop = Loop(
            NoOpModel(dict.fromkeys(KEYS, 0.5), eval_outputs={}),
            {"train": [[0]] * batches},
            plugins={"clock": clock, "records": Records(), "mlflow": plugin},
            run_dir=Path(tmp) / "run",
            max_epochs=1,
            handle_signals=False,
        )
        loop.run()
        drain = time.perf_counter() - clock.start
        client_cpu = time.process_time() - clock.cpu
    tracker = plugin.finished
    assert tracker is not None and tracker.mlflow_run_id is not None
    run = MlflowClient(uri).get_run(tracker.mlflow_run_id)
    arrived = sum(len(MlflowClient(uri).get_metric_history(run.info.run_id, key)) for key in KEYS)
    return {"drain": drain, "client_cpu": client_cpu, "arrived": arrived, "status": run.info.status}


# -- the server and the rounds -----------------------------------------------------------------


def server_cpu(server: Server) -> float:
    """CPU seconds of every process of *server*'s process group so far (from ``/proc``)."""
    assert server.process is not None
    total = 0.0
    tick = os.sysconf("SC_CLK_TCK")
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == server.process.pid:  # the process group id
            total += (int(fields[11]) + int(fields[12])) / tick
    return total


def sources(before: str | None, tmp: Path) -> dict[str, str]:
    """``{label: PYTHONPATH}`` of the plugin versions to compare."""
    current = os.pathsep.join(
        [str(p) for p in [ROOT / "src", *sorted(ROOT.glob("plugins/*/src"))]]
        + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])
    )
    if before is None:
        return {"after": current}
    folder = tmp / "before"
    folder.mkdir()
    command = ["git", "-C", str(ROOT), "archive", before, "plugins/epochal-mlflow/src"]
    archive = subprocess.run(command, check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True)
    return {
        f"before ({before})": os.pathsep.join([str(folder / "plugins/epochal-mlflow/src"), current]),
        "after": current,
    }


def measure(server: Server, path: str, records: int) -> dict[str, Any]:
    cpu = server_cpu(server)
    done = subprocess.run(
        [sys.executable, __file__, "--one", server.uri, "--records", str(records)],
        env={**os.environ, "PYTHONPATH": path},
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-3000:])
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    result["server_cpu"] = server_cpu(server) - cpu
    if result["arrived"] != records or result["status"] != "FINISHED":
        raise RuntimeError(f"records lost or run not finished: {result}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=rounds, default=100_000)
    parser.add_argument("--rounds", type=rounds, default=3)
    parser.add_argument("--workers", type=rounds, nargs="+", default=[1, 4])
    parser.add_argument("--before", help="a git revision: also run the plugin as it was there")
    parser.add_argument("--one", metavar="URI", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one_round(args.one, args.records)))
        return
    print(f"{args.records} records, {len(KEYS)} a batch; medians of {args.rounds} interleaved rounds")
    print(f"{os.cpu_count()} cores, Python {sys.version.split()[0]}, mlflow {version('mlflow')}")
    print()
    print("| server workers | plugin | drain | records/s | plugin CPU | server CPU | drain vs first |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        paths = sources(args.before, Path(tmp))
        for workers in args.workers:
            root = Path(tmp) / f"server-{workers}"
            root.mkdir()
            server = Server(root, workers=workers)
            try:
                server.start()
                results: dict[str, list[dict[str, Any]]] = {label: [] for label in paths}
                for _ in range(args.rounds):
                    for label, path in paths.items():
                        results[label].append(measure(server, path, args.records))
            finally:
                server.stop()
            drains = {label: statistics.median(r["drain"] for r in rs) for label, rs in results.items()}
            first = next(iter(drains.values()))
            for label, rs in results.items():
                cpu = statistics.median(r["server_cpu"] for r in rs)
                client = statistics.median(r["client_cpu"] for r in rs)
                print(
                    f"| {workers} | {label} | {drains[label]:.2f} s | {args.records / drains[label]:,.0f} | "
                    f"{client:.2f} s | {cpu:.2f} s | {drains[label] / first:.2f}× |"
                )


if __name__ == "__main__":
    main()
