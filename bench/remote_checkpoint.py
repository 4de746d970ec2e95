"""What a checkpoint save costs on a remote store, and that the local save did not move.

Each case runs a ``Loop`` of the synthetic model (``epochal_checkpoint.testing``: ``--size``
float32 values, 4 arrays) in a child process that saves after every batch (``keep_last = 2``,
so every save from the third on also prunes one) and times ``Checkpoint._write`` (the write,
the upload where there is one, the pruning) of each save after the first two. Cases:

- ``local``: a local directory (the engine of format 4: fsyncs, rename, ``latest`` link);
- ``base local``: the same on the tree of ``--base`` (a git worktree made in a temporary
  folder): the local save of the tree before the remote store, side by side;
- ``memory://``: fsspec's in-memory filesystem (the staging write plus the store's protocol,
  no network);
- ``s3 (moto)``: moto's S3 server on 127.0.0.1, in this process (an S3 API over HTTP; far
  slower per request than a real S3 endpoint's throughput, so an upper bound of the protocol's
  cost, not a figure for AWS).

Rounds alternate the order of the cases (the load of a shared machine hits all alike);
reported: each case's median save time over all rounds and the median of the per-round ratios
to ``local``.

    python bench/remote_checkpoint.py [--base main] [--size 4000000] [--saves 12] [--rounds 3]
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
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
KEYS = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"}


def source_path(tree: Path) -> str:
    folders = [tree / "src", *sorted(tree.glob("plugins/*/src")), *sorted(tree.glob("examples/*/src"))]
    return os.pathsep.join(str(folder) for folder in folders)


def child(where: str, size: int, saves: int) -> None:
    """Run the loop saving to *where*; print the times of ``_write`` (seconds) as JSON."""
    from epochal_checkpoint import Checkpoint
    from epochal_checkpoint.testing import make_data, make_model

    from epochal import Loop

    plugin = Checkpoint(dir=where, every_n_batches=1, every_n_epochs=0, keep_last=2, save_at_end=False)
    times: list[float] = []
    write = plugin._write

    def timed(*args: Any, **kwargs: Any) -> None:
        start = time.perf_counter()
        write(*args, **kwargs)
        times.append(time.perf_counter() - start)

    plugin._write = timed  # type: ignore[method-assign]
    loop = Loop(
        make_model(size),
        make_data(),
        plugins={"checkpoint": plugin},
        seed=0,
        max_iterations=saves + 2,
        handle_signals=False,
    )
    loop.run()
    print(json.dumps(times[2:]))


def run_case(tree: Path, where: str, size: int, saves: int, env: dict[str, str]) -> list[float]:
    environment = {**os.environ, **env, "PYTHONPATH": source_path(tree)}
    done = subprocess.run(
        [sys.executable, str(HERE / "remote_checkpoint.py"), "--child", where, str(size), str(saves)],
        env=environment,
        capture_output=True,
        text=True,
        cwd=tree,
    )
    if done.returncode != 0:
        raise SystemExit(f"{where} on {tree}: {done.stderr[-2000:]}")
    return [float(t) for t in json.loads(done.stdout.strip().splitlines()[-1])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--base", default=None, help="a git revision: its local save side by side")
    parser.add_argument("--size", type=int, default=4_000_000, help="float32 values of the model")
    parser.add_argument("--saves", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--local-only", action="store_true", help="only local against --base")
    args = parser.parse_args()
    if args.child:
        child(args.child[0], int(args.child[1]), int(args.child[2]))
        return

    import logging

    import fsspec
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # a line per request otherwise
    server = ThreadedMotoServer("127.0.0.1", 0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    fsspec.filesystem("s3", endpoint_url=endpoint, key="bench", secret="bench").mkdir("bench")
    s3_env = {**KEYS, "AWS_ENDPOINT_URL": endpoint}
    with tempfile.TemporaryDirectory(dir=ROOT) as scratch:
        base = Path(scratch) / "base"
        if args.base:
            subprocess.run(
                ["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(base), args.base],
                check=True,
            )
        try:
            cases: dict[str, tuple[Path, str, dict[str, str]]] = {
                "local": (ROOT, str(Path(scratch) / "local"), {}),
                "memory://": (ROOT, "memory://bench/run", {}),
                "s3 (moto)": (ROOT, "s3://bench/run", s3_env),
            }
            if args.local_only:
                del cases["memory://"], cases["s3 (moto)"]
            if args.base:
                cases["base local"] = (base, str(Path(scratch) / "base-local"), {})
            results: dict[str, list[list[float]]] = {name: [] for name in cases}
            for round_ in range(args.rounds):
                order = list(cases) if round_ % 2 == 0 else list(reversed(cases))
                for name in order:
                    tree, where, env = cases[name]
                    if not where.startswith(("s3:", "memory:")):
                        where = f"{where}-{round_}"
                    else:
                        where = f"{where}{round_}"
                    results[name].append(run_case(tree, where, args.size, args.saves, env))
        finally:
            if args.base:
                remove = ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)]
                subprocess.run(remove, check=False)
    server.stop()

    mb = args.size * 4 / (1 << 20)
    print(f"save of {mb:.0f} MB of float32 state, {args.saves} saves x {args.rounds} rounds, each pruning")
    print(f"{'case':<12} {'median ms':>10} {'x local (median of rounds)':>28} {'spread':>14}")
    for name, rounds in results.items():
        everything = [t for times in rounds for t in times]
        ratios = [
            statistics.median(times) / statistics.median(local)
            for times, local in zip(rounds, results["local"], strict=True)
        ]
        print(
            f"{name:<12} {statistics.median(everything) * 1e3:>10.1f} {statistics.median(ratios):>27.2f}x"
            f" {min(ratios):>6.2f}-{max(ratios):.2f}x"
        )


if __name__ == "__main__":
    main()
