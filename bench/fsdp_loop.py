"""FSDP2 on 2 processes: epochal's ``TorchModel(strategy="fsdp")`` step against a raw FSDP2 loop.

What is measured: time per example of whole training runs (``EPOCHS`` epochs over ``N``
synthetic examples, ``BATCH`` examples per process per step, an MLP of ``DEPTH`` hidden layers
of ``WIDTH``, AdamW), timed inside the processes between two barriers (process start, the
process group and the sharding are not counted), on 2 processes (``torch.distributed.run
--standalone``; gloo and one torch thread per process on CPUs, NCCL on GPUs):

* ``raw``: a hand-written FSDP2 loop: ``fully_shard`` on each hidden layer then the root over a
  ``DeviceMesh`` of the 2 ranks, AdamW made on the sharded parameters, each epoch this rank's
  shard of the same ``(seed, epoch)`` order as epochal's, ``zero_grad / forward / loss /
  backward / step``, the loss read on the host every 100 steps.
* ``epochal``: ``Loop(TorchModel(module, AdamW(module.parameters()), ..., strategy="fsdp"),
  {"train": BatchStream(...)}, plugins={})``: the loop shards the stream, the model shards the
  module (the same units, before the clock starts) and re-points the optimizer.
* ``every8``: the same with ``[distributed] agree_every_n_batches = 8`` (the ranks agree on
  stops every 8 batches instead of after each: one gloo all-reduce less per batch).

Rounds are interleaved; the medians and the median of the per-round ratios epochal/raw are
reported (goal <= 1.05). ``python bench/fsdp_loop.py``; ``BENCH_ROUNDS``, ``BENCH_EPOCHS``,
``BENCH_N``, ``BENCH_BATCH``, ``BENCH_WIDTH``, ``BENCH_DEPTH``, ``BENCH_JSON`` override the
defaults. The device is CUDA when torch sees one (each rank its GPU), else the CPU.
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
EPOCHS = int(os.environ.get("BENCH_EPOCHS", 1))
N = int(os.environ.get("BENCH_N", 6400))
BATCH = int(os.environ.get("BENCH_BATCH", 64))
WIDTH = int(os.environ.get("BENCH_WIDTH", 256))
DEPTH = int(os.environ.get("BENCH_DEPTH", 4))
#: ``[distributed] agree_every_n_batches`` of the epochal cases.
AGREE = {"epochal": "auto", "every8": 8}
CASES = ("raw", "epochal", "every8")


def setup(device: Any) -> tuple[Any, Any, Any]:
    import torch

    if device.type == "cpu":
        torch.set_num_threads(1)
    torch.manual_seed(0)
    layers: list[Any] = [torch.nn.Linear(128, WIDTH), torch.nn.ReLU()]
    for _ in range(DEPTH - 1):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU()]
    module = torch.nn.Sequential(*layers, torch.nn.Linear(WIDTH, 10)).to(device)
    x, y = synthetic_data(N)
    return module, x, y


def run_raw(world: Any, device: Any, module: Any, x: Any, y: Any) -> Callable[[], int]:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from epochal.data import BatchStream

    mesh = init_device_mesh(device.type, (world.size,))
    for layer in module:
        if any(True for _ in layer.parameters()):
            fully_shard(layer, mesh=mesh)
    fully_shard(module, mesh=mesh)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
    stream = BatchStream(x, y, batch_size=BATCH, seed=0).shard(world.rank, world.size, "error")
    return raw_loop(module, optimizer, stream, x, y, epochs=EPOCHS, batch=BATCH, device=device)


def run_epochal(world: Any, device: Any, module: Any, x: Any, y: Any, case: str) -> Callable[[], int]:
    from dataclasses import replace

    import torch

    from epochal import Loop
    from epochal.data import BatchStream
    from epochal.torch import TorchModel

    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
    model = TorchModel(
        module, optimizer, torch.nn.functional.cross_entropy, device=str(device), strategy="fsdp"
    )
    data = {"train": BatchStream(x, y, batch_size=BATCH, seed=0)}
    world = replace(world, agree_every_n_batches=AGREE[case])
    loop = Loop(model, data, plugins={}, max_epochs=EPOCHS, world=world, handle_signals=False)
    model.distribute(world)  # off the clock, as raw shards before timing (the loop's call is then a no-op)

    def run() -> int:
        loop.run()
        return loop.iteration

    return run


def worker(case: str) -> None:
    """One timed run of *case* in this process (rank 0 prints the figures as JSON)."""
    import torch

    from epochal.distributed import init_from_env, shutdown

    world = init_from_env()
    device = torch.device("cuda", world.local_rank) if torch.cuda.is_available() else torch.device("cpu")
    module, x, y = setup(device)
    if case == "raw":
        run = run_raw(world, device, module, x, y)
    else:
        run = run_epochal(world, device, module, x, y, case)
    time_run(world, run, BATCH, device)
    shutdown()


def launch(case: str) -> dict[str, Any]:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    command += [str(Path(__file__).resolve()), "worker", case]
    return _torch_loops.launch(command, case)


def main() -> None:
    times: dict[str, list[float]] = {case: [] for case in CASES}
    device = "?"
    for round_ in range(ROUNDS):
        for case in CASES:
            figures = launch(case)
            times[case].append(figures["per_example_us"])
            device = figures["device"]
        print(f"round {round_ + 1}/{ROUNDS} done", file=sys.stderr, flush=True)
    median = {case: statistics.median(values) for case, values in times.items()}
    print(f"MLP 128-{WIDTH}x{DEPTH}-10, AdamW, {N} examples x {EPOCHS} epochs, {BATCH} per process per step,")
    print(f"2 processes on {device}, median of {ROUNDS} interleaved rounds\n")
    print("| case | us per example | examples/s | vs raw |")
    print("|---|---|---|---|")
    for case in CASES:
        value = median[case]
        print(f"| {case} | {value:.2f} | {1e6 / value:,.0f} | {value / median['raw']:.3f}x |")
    print("\nmedians of the per-round ratios (each round's cases ran back to back):")
    for case in CASES[1:]:
        paired = [e / r for e, r in zip(times[case], times["raw"])]
        print(f"- {case} / raw: {statistics.median(paired):.3f}x")
    out = os.environ.get("BENCH_JSON")
    if out:
        Path(out).write_text(json.dumps(times, indent=1))


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "worker":
        worker(sys.argv[2])
    else:
        main()
