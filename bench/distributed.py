"""What agreeing on decisions costs a run on 2 processes (gloo over loopback), per batch.

Two processes train the same loop for a fixed number of batches, in three variants measured side
by side and interleaved, in one pair of processes:

- ``none``: the loop with its agreement unregistered (the ranks could not stop together: the
  floor, for comparison only);
- ``async``: the loop as it runs on several processes (an asynchronous MAX all-reduce of the
  stop flags started after every batch and read after the next one, a blocking one per epoch);
- ``every 8``: the same with ``[distributed] agree_every_n_batches = 8``;
- ``blocking``: the naive protocol, a blocking all-reduce of the flags after every batch.

With two models: a no-op step (the pure cost per batch) and a step that all-reduces a gradient
of ``--grad`` float32 values (a small data-parallel model: what the agreement rides beside).
And, on one process, the loop before and after ``epochal.distributed`` (no agreement, nothing
registered: the single-process path must not get slower) is what ``bench/loop_overhead.py``
measures.

    python bench/distributed.py [--batches 2000] [--repeats 5] [--grad 100000]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
from typing import Any

import numpy as np
import torch.multiprocessing as mp

from epochal import hookimpl

OUTPUTS = {"loss": 0.0}
VARIANTS = ("none", "async", "every 8", "blocking")


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

    if variant == "every 8":
        world = replace(world, agree_every_n_batches=8)
    data = {"train": [np.zeros(1)] * (batches * world.size)}  # a list: sharded batch by batch
    loop = Loop(Model(grad), data, max_epochs=1, handle_signals=False, world=world)
    pm = loop.plugin_set.pm
    if variant not in ("async", "every 8"):
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


def worker(rank: int, size: int, port: int, args: argparse.Namespace, results: Any) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(size), LOCAL_RANK=str(rank))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    from epochal.distributed import init_from_env, shutdown

    world = init_from_env("gloo", timeout=120)
    times: dict[tuple[int, str], list[float]] = {}
    for _ in range(args.repeats):
        for grad in (0, args.grad):
            for variant in VARIANTS:
                times.setdefault((grad, variant), []).append(one_run(world, variant, args.batches, grad))
    if rank == 0:
        results.put({key: statistics.median(values) for key, values in times.items()})
    shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--grad", type=int, default=100_000)
    args = parser.parse_args()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    mp.start_processes(worker, args=(2, port, args, results), nprocs=2, start_method="spawn")
    medians = results.get()
    print(f"2 processes (gloo, loopback), {args.batches} batches per run, median of {args.repeats}")
    print(
        "| step | no agreement | async, every batch (default) | async, every 8 | blocking per batch "
        "| async / none | every 8 / none | blocking / none |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for grad in (0, args.grad):
        none, ours, every8, blocking = (medians[(grad, v)] for v in VARIANTS)
        label = "no-op" if grad == 0 else f"all-reduce of {grad:,} float32"
        print(
            f"| {label} | {none * 1e6:.1f} µs | {ours * 1e6:.1f} µs | {every8 * 1e6:.1f} µs "
            f"| {blocking * 1e6:.1f} µs | {ours / none:.2f}× | {every8 / none:.2f}× "
            f"| {blocking / none:.2f}× |"
        )


if __name__ == "__main__":
    main()
