"""Several processes on the CPU: epochal's DDP loop on 1 vs 2 processes, and against a raw DDP loop.

What is measured: examples per second of whole training runs (``EPOCHS`` epochs over ``N``
synthetic examples, ``BATCH`` examples per process per step, an MLP, SGD), timed inside the
processes between two barriers (process start and the joining of the process group are not
counted). The cases, each on 1 process (plain ``python``) and on 2 (``torch.distributed.run
--standalone``, gloo over loopback, one torch thread per process):

* ``raw``: a hand-written DDP loop: ``DistributedDataParallel(module)``, each epoch this rank's
  shard of the same ``(seed, epoch)`` order as epochal's, numpy batches by fancy indexing,
  ``zero_grad / forward / loss / backward / step``, the loss read on the host every 100 steps.
* ``epochal``: ``Loop(TorchModel(module, ...), {"train": BatchStream(...)}, plugins={})``: the
  loop shards the stream and wraps the module in DDP itself.
* ``six`` and ``six-before`` (issue 32): the same with the six standard plugins (monitor writing
  a running record every batch, early_stopping, checkpoint, sqlite_log, timing, progress);
  ``six`` with the defaults, ``six-before`` with the options that keep the collectives of
  before issue 32 (``agree_every_n_batches = 1``, monitor ``reduce = "step"``).

Rounds are interleaved (every case once per round); the medians are reported with the ratios
epochal/raw (time per example: goal <= 1.05) and 2 processes / 1 process (throughput).
``python bench/ddp_loop.py``; ``BENCH_ROUNDS``, ``BENCH_EPOCHS``, ``BENCH_N``, ``BENCH_BATCH``,
``BENCH_WIDTH``, ``BENCH_JSON`` (a file for the figures) override the defaults.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _torch_loops
from _torch_loops import raw_loop, synthetic_data, time_run

ROUNDS = int(os.environ.get("BENCH_ROUNDS", 5))
EPOCHS = int(os.environ.get("BENCH_EPOCHS", 2))
N = int(os.environ.get("BENCH_N", 12800))
BATCH = int(os.environ.get("BENCH_BATCH", 64))
WIDTH = int(os.environ.get("BENCH_WIDTH", 256))
CASES = ("raw", "epochal", "six", "six-before")
SIX = ("monitor", "early_stopping", "checkpoint", "sqlite_log", "timing", "progress")


def setup() -> tuple[Any, Any, Any, Any]:
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    module = torch.nn.Sequential(
        torch.nn.Linear(128, WIDTH), torch.nn.ReLU(), torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU(),
        torch.nn.Linear(WIDTH, 10),
    )  # fmt: skip
    x, y = synthetic_data(N)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.01)
    return module, optimizer, x, y


def run_raw(world: Any, module: Any, optimizer: Any, x: Any, y: Any) -> Callable[[], int]:
    import torch

    from epochal.data import BatchStream

    if world.distributed:
        module = torch.nn.parallel.DistributedDataParallel(module)
    stream = BatchStream(x, y, batch_size=BATCH, seed=0)
    if world.distributed:
        stream = stream.shard(world.rank, world.size, "error")
    return raw_loop(module, optimizer, stream, x, y, epochs=EPOCHS, batch=BATCH, device=torch.device("cpu"))


def run_epochal(
    world: Any, module: Any, optimizer: Any, x: Any, y: Any, case: str = "epochal"
) -> Callable[[], int]:
    import atexit
    import shutil
    import tempfile
    from dataclasses import replace

    import torch

    from epochal import Loop, load_plugins
    from epochal.data import BatchStream
    from epochal.torch import TorchModel

    model = TorchModel(module, optimizer, torch.nn.functional.cross_entropy, device="cpu")
    data = {"train": BatchStream(x, y, batch_size=BATCH, seed=0)}
    plugins: Any = {}
    if case.startswith("six"):
        before = case == "six-before"
        world = replace(world, agree_every_n_batches=1 if before else "auto")
        directory = tempfile.mkdtemp(prefix="bench-ddp-")
        atexit.register(shutil.rmtree, directory, ignore_errors=True)
        options = {
            "monitor": {"every_n_batches": 1, "reduce": "step" if before else "epoch"},
            "early_stopping": {"monitor": "train.loss"},
            "checkpoint": {"dir": f"{directory}/checkpoints"},
            "sqlite_log": {"path": f"{directory}/log.sqlite"},
        }
        plugins = load_plugins(order=SIX, autoload=False, options=options)
    loop = Loop(model, data, plugins=plugins, max_epochs=EPOCHS, world=world, handle_signals=False)

    def run() -> int:
        loop.run()
        return loop.iteration

    return run


def worker(case: str) -> None:
    """One timed run of *case* in this process (rank 0 prints the figures as JSON)."""
    import torch

    from epochal.distributed import init_from_env, shutdown

    world = init_from_env()
    module, optimizer, x, y = setup()
    if case == "raw":
        run = run_raw(world, module, optimizer, x, y)  # built off the clock
    else:
        run = run_epochal(world, module, optimizer, x, y, case)
    time_run(world, run, BATCH, torch.device("cpu"))
    shutdown()


def launch(case: str, nproc: int) -> dict[str, float]:
    script = [str(Path(__file__).resolve()), "worker", case]
    if nproc == 1:
        command = [sys.executable, *script]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
        command += script
    return _torch_loops.launch(command, f"{case} on {nproc}")


def main() -> None:
    keys = [(case, nproc) for nproc in (1, 2) for case in CASES]
    times: dict[tuple[str, int], list[float]] = {key: [] for key in keys}
    for round_ in range(ROUNDS):
        for case, nproc in keys:
            times[(case, nproc)].append(launch(case, nproc)["per_example_us"])
        print(f"round {round_ + 1}/{ROUNDS} done", file=sys.stderr, flush=True)
    median = {key: statistics.median(values) for key, values in times.items()}
    print(f"MLP 128-{WIDTH}-{WIDTH}-10, {N} examples x {EPOCHS} epochs, {BATCH} per process per step,")
    print(f"median of {ROUNDS} interleaved rounds (CPU, gloo, 1 torch thread per process)\n")
    print(
        "| case | processes | us per example | examples/s | vs raw (same processes) | 2 vs 1 (throughput) |"
    )
    print("|---|---|---|---|---|---|")
    for case, nproc in keys:
        value = median[(case, nproc)]
        versus = value / median[("raw", nproc)]
        scaling = median[(case, 1)] / value if nproc == 2 else 1.0
        print(f"| {case} | {nproc} | {value:.2f} | {1e6 / value:,.0f} | {versus:.3f}x | {scaling:.2f}x |")
    print("\nmedians of the per-round ratios (each round's cases ran back to back):")
    for nproc in (1, 2):
        for case in CASES[1:]:
            paired = [e / r for e, r in zip(times[(case, nproc)], times[("raw", nproc)])]
            print(f"- {case} / raw on {nproc} process(es): {statistics.median(paired):.3f}x")
    for case in CASES:
        paired = [one / two for one, two in zip(times[(case, 1)], times[(case, 2)])]
        print(f"- {case}: throughput of 2 processes / 1 process: {statistics.median(paired):.2f}x")
    out = os.environ.get("BENCH_JSON")
    if out:
        Path(out).write_text(json.dumps({f"{c}/{n}": v for (c, n), v in times.items()}, indent=1))


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "worker":
        worker(sys.argv[2])
    else:
        main()
