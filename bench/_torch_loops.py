"""Pieces ``bench/ddp_loop.py`` and ``bench/fsdp_loop.py`` share: the synthetic data, the
hand-written training loop they compare epochal with, the timed run inside the processes, and the
launch of the processes.

Imported by those scripts (``sys.path`` holds ``bench/`` when a script runs); it runs nothing
itself. torch is imported inside the functions, as the scripts' own parts do.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Callable
from typing import Any


def synthetic_data(n: int) -> tuple[Any, Any]:
    """*n* examples of 128 standard-normal features and a label in 0..9 (seed 0)."""
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, 128)).astype(np.float32)
    y = rng.integers(0, 10, n)
    return x, y


def raw_loop(
    module: Any, optimizer: Any, stream: Any, x: Any, y: Any, *, epochs: int, batch: int, device: Any
) -> Callable[[], int]:
    """A hand-written training loop: each epoch the order of *stream* (this rank's shard),
    numpy batches by fancy indexing (moved to *device* unless it is the CPU), ``zero_grad /
    forward / loss / backward / step``, the loss read on the host every 100 steps. The call
    returns the steps taken."""
    import torch

    loss_fn = torch.nn.functional.cross_entropy
    move = device.type != "cpu"

    def run() -> int:
        steps = 0
        for epoch in range(epochs):
            order = stream.indices(epoch)
            for k in range(0, len(order), batch):
                index = order[k : k + batch]
                xb, yb = torch.from_numpy(x[index]), torch.from_numpy(y[index])
                if move:
                    xb, yb = xb.to(device, non_blocking=True), yb.to(device, non_blocking=True)
                optimizer.zero_grad(set_to_none=True)
                loss = loss_fn(module(xb), yb)
                loss.backward()
                optimizer.step()
                steps += 1
                if steps % 100 == 0:
                    loss.item()
        return steps

    return run


def time_run(world: Any, run: Callable[[], int], batch: int, device: Any) -> None:
    """Time *run* between two barriers of *world* (waiting for the GPU's work on CUDA); rank 0
    prints ``{"seconds", "steps", "examples", "device"}`` as one JSON line."""
    import torch

    world.barrier()
    started = time.perf_counter()
    steps = run()
    if device.type == "cuda":
        torch.cuda.synchronize()
    world.barrier()
    seconds = time.perf_counter() - started
    if world.is_zero:
        examples = steps * batch * world.size
        figures = {"seconds": seconds, "steps": steps, "examples": examples, "device": str(device)}
        print(json.dumps(figures), flush=True)


def launch(command: list[str], what: str) -> dict[str, Any]:
    """Run *command* (one torch thread per process) and read rank 0's figures, with
    ``per_example_us``; *what* names the case in the error if it fails."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600, check=False)
    if result.returncode:
        raise RuntimeError(f"{what}: {result.stderr[-3000:]}")
    line = [line for line in result.stdout.splitlines() if line.startswith("{")][-1]
    figures = json.loads(line)
    return {"per_example_us": figures["seconds"] / figures["examples"] * 1e6, **figures}
