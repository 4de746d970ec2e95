"""What agreeing on decisions costs a run on 2 processes (gloo over loopback), per batch.

Two processes train the same loop for a fixed number of batches, in variants measured side by
side and interleaved, in one pair of processes. First, the agreement alone (no plugin):

- ``none``: the loop with its agreement unregistered (the ranks could not stop together: the
  floor, for comparison only);
- ``async``: the loop as it runs on several processes (an asynchronous MAX all-reduce of the
  stop flags started after every batch and read after the next one, a blocking one per epoch);
- ``every 8``: the same with ``[distributed] agree_every_n_batches = 8``;
- ``auto``: ``agree_every_n_batches = "auto"`` (the default since issue 32: n chosen from the
  measured round trip and step time, the 16 calibration batches and its round trips included);
- ``blocking``: the naive protocol, a blocking all-reduce of the flags after every batch.

With two models: a no-op step (the pure cost per batch) and a step that all-reduces a gradient
of ``--grad`` float32 values (a small data-parallel model: what the agreement rides beside).
Then (issue 32) the CPU time per step of the 2 processes (``time.process_time``: every thread
of the process, gloo's included; rank 0's) with the gradient step, against a hand-written loop
of the same steps (``raw``: the shard's batches, ``train_step``, nothing else):

- ``no plugins`` and ``six plugins`` (monitor with ``every_n_batches = 1``, early_stopping,
  checkpoint, sqlite_log, timing, progress), each ``before`` (the collectives of before issue
  32, through the options that keep them: ``agree_every_n_batches = 1``, monitor
  ``reduce = "step"``) and ``after`` (the defaults: ``"auto"``, ``reduce = "epoch"``).

And, on one process, the loop before and after ``epochal.distributed`` (no agreement, nothing
registered: the single-process path must not get slower) is what ``bench/loop_overhead.py``
measures.

    python bench/distributed.py [--batches 2000] [--repeats 5] [--grad 100000] [--part agreement,plugins]
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import tempfile
import time
from typing import Any

import numpy as np
import torch.multiprocessing as mp

from epochal import hookimpl

OUTPUTS = {"loss": 0.0}
VARIANTS = ("none", "async", "every 8", "auto", "blocking")
#: (plugins, collectives): the cases of the CPU per step table; "raw" is the hand-written loop.
CASES = (
    ("raw", ""),
    ("no plugins", "before"),
    ("no plugins", "after"),
    ("six plugins", "before"),
    ("six plugins", "after"),
)
SIX = ("monitor", "early_stopping", "checkpoint", "sqlite_log", "timing", "progress")


class Model:
    def __init__(self, grad: int) -> None:
        self.grad = np.ones(grad, dtype=np.float32) if grad else None
        self.world: Any = None

    def distribute(self, world: Any) -> None:
        self.world = world

    def train_step(self, batch: Any) -> dict[str, float]:
        if self.grad is not None:
            self.world.all_reduce_arrays([self.grad])
        return OUTPUTS

    def eval_step(self, batch: Any) -> dict[str, float]:
        return OUTPUTS

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Any) -> None:
        pass


class Blocking:
    """The naive agreement: a blocking all-reduce of the flags after every batch."""

    def __init__(self, world: Any) -> None:
        self.world = world

    @hookimpl(trylast=True)
    def after_batch(self, loop: Any) -> None:
        stopping = loop.stopping
        values = self.world.all_reduce([stopping.requested is not None, 0, 0, 0, 0, 0, 0], "max")
        if values[0]:
            stopping.decide("stop")


def one_run(world: Any, variant: str, batches: int, grad: int) -> float:
    from dataclasses import replace

    from epochal import Loop
    from epochal.stopping import Stop

    world = replace(world, agree_every_n_batches={"every 8": 8, "auto": "auto"}.get(variant, 1))
    data = {"train": [np.zeros(1)] * (batches * world.size)}  # a list: sharded batch by batch
    loop = Loop(Model(grad), data, max_epochs=1, handle_signals=False, world=world)
    pm = loop.plugin_set.pm
    if variant not in ("async", "every 8", "auto"):
        pm.unregister(name="epochal.agreement")
        loop.stopping = Stop()  # one process's: stops are not agreed
        if variant == "blocking":
            pm.register(Blocking(world), name="bench.blocking")
        loop.hooks.rebuild()
    world.barrier()
    started = time.perf_counter()
    loop.run()
    world.barrier()
    return (time.perf_counter() - started) / batches


def one_case(world: Any, plugins: str, collectives: str, batches: int, grad: int) -> tuple[float, float]:
    """Seconds of CPU and of wall time per step of one run of a CASES entry."""
    from dataclasses import replace

    from epochal import Loop, load_plugins

    data = {"train": [np.zeros(1)] * (batches * world.size)}
    directory = tempfile.mkdtemp(prefix="bench-distributed-")
    before = collectives == "before"
    model = Model(grad)
    if plugins == "raw":
        model.distribute(world)
        shard = data["train"][world.rank :: world.size]

        def run() -> None:
            for batch in shard:
                model.train_step(batch)
    else:
        world = replace(world, agree_every_n_batches=1 if before else "auto")
        options = {
            "monitor": {"every_n_batches": 1, "reduce": "step" if before else "epoch"},
            "early_stopping": {"monitor": "train.loss"},
            "checkpoint": {"dir": f"{directory}/checkpoints"},
            "sqlite_log": {"path": f"{directory}/log.sqlite"},
        }
        chosen = load_plugins(order=SIX, autoload=False, options=options) if plugins == "six plugins" else {}
        loop = Loop(
            model, data, plugins=chosen, max_epochs=1, handle_signals=False, world=world, run_dir=directory
        )
        run = loop.run
    world.barrier()
    cpu, wall = time.process_time(), time.perf_counter()
    run()
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    world.barrier()
    shutil.rmtree(directory, ignore_errors=True)
    return cpu / batches, wall / batches


def worker(rank: int, size: int, port: int, args: argparse.Namespace, results: Any) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(size), LOCAL_RANK=str(rank))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import contextlib
    import io

    from epochal.distributed import init_from_env, shutdown

    world = init_from_env("gloo", timeout=120)
    times: dict[Any, list[float]] = {}
    for _ in range(args.repeats):
        if "agreement" in args.part:
            for grad in (0, args.grad):
                for variant in VARIANTS:
                    times.setdefault((grad, variant), []).append(one_run(world, variant, args.batches, grad))
        if "plugins" in args.part:
            for case in CASES:
                with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
                    cpu, wall = one_case(world, *case, args.batches, args.grad)
                times.setdefault(("cpu", *case), []).append(cpu)
                times.setdefault(("wall", *case), []).append(wall)
    if rank == 0:
        results.put({key: (statistics.median(values), values) for key, values in times.items()})
    shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--grad", type=int, default=100_000)
    parser.add_argument("--part", default="agreement,plugins")
    args = parser.parse_args()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    mp.start_processes(worker, args=(2, port, args, results), nprocs=2, start_method="spawn")
    found = results.get()
    medians = {key: value[0] for key, value in found.items()}
    print(f"2 processes (gloo, loopback), {args.batches} batches per run, median of {args.repeats}")
    if "agreement" in args.part:
        print(
            "| step | no agreement | async, every batch | async, every 8 | auto (default) "
            "| blocking per batch | async / none | every 8 / none | auto / none | blocking / none |"
        )
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for grad in (0, args.grad):
            none, ours, every8, auto, blocking = (medians[(grad, v)] for v in VARIANTS)
            label = "no-op" if grad == 0 else f"all-reduce of {grad:,} float32"
            print(
                f"| {label} | {none * 1e6:.1f} µs | {ours * 1e6:.1f} µs | {every8 * 1e6:.1f} µs "
                f"| {auto * 1e6:.1f} µs | {blocking * 1e6:.1f} µs | {ours / none:.2f}× "
                f"| {every8 / none:.2f}× | {auto / none:.3f}× | {blocking / none:.2f}× |"
            )
    if "plugins" in args.part:
        print(f"\nCPU per step (rank 0's process, every thread), step = all-reduce of {args.grad:,} float32")
        print("| case | collectives | CPU µs/step | wall µs/step | CPU / raw (median of per-run ratios) |")
        print("|---|---|---:|---:|---:|")
        raw = found[("cpu", "raw", "")][1]
        for case in CASES:
            runs = found[("cpu", *case)][1]
            ratio = statistics.median(c / r for c, r in zip(runs, raw))
            print(
                f"| {case[0]} | {case[1] or '-'} | {medians[('cpu', *case)] * 1e6:.1f} "
                f"| {medians[('wall', *case)] * 1e6:.1f} | {ratio:.3f}× |"
            )


if __name__ == "__main__":
    main()
