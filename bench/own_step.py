"""A training step of your own against TorchModel's built-in step, on the same model.

What is measured: the process CPU time of whole runs (``Loop.run()``, no plugins, ``EPOCHS``
epochs of ``STEPS`` batches already made), divided by the steps. The cases, on the same MLP, data
and optimizer:

* ``built-in``: ``TorchModel(net, opt, cross_entropy)``: the ``loss_fn`` step.
* ``own (function)``: ``TorchModel(net, opt, training_step=step)`` with
  ``step(model, batch) = cross_entropy(model.module(x), y)``: the same computation.
* ``own (subclass)``: the same step as the ``training_step`` method of a subclass.
* ``own (manual)``: ``automatic_optimization=False``: the step calls ``model.backward`` and
  ``model.optimizer_step`` itself (and zeroes the gradients, as a loop does).
* ``raw loop``: ``zero_grad / forward / loss / backward / step`` in plain PyTorch (the floor).

Rounds are interleaved (every case once per round, the order rotating); reported per case: the
median per step, the median over the rounds of its ratio to ``built-in`` (with the spread), and
the ratio of its fastest run to ``built-in``'s fastest (another process's load only adds time).
One intra-op thread (``torch.set_num_threads(1)``), so that a shared machine's other load
perturbs less.

    python bench/own_step.py [--rounds 9] [--steps 300] [--epochs 2] [--width 64]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from _common import rounds

from epochal import Loop
from epochal.torch import TorchModel

F = torch.nn.functional


def batches(steps: int, width: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [
        (torch.randn(32, width, generator=generator), torch.randint(0, 10, (32,), generator=generator))
        for _ in range(steps)
    ]


def net(width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, 10))


def own(model: TorchModel, batch: Any) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model.module(x), y)


def manual(model: TorchModel, batch: Any) -> dict[str, torch.Tensor]:
    x, y = batch
    model.optimizer.zero_grad()  # type: ignore[union-attr]
    loss = F.cross_entropy(model.module(x), y)
    model.backward(loss)
    model.optimizer_step()
    return {"loss": loss}


class Subclass(TorchModel):
    def training_step(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.module(x), y)


def cases(width: int) -> dict[str, Callable[[], Any]]:
    def made(kind: str) -> Callable[[], Any]:
        def make() -> Any:
            module = net(width)
            optimizer = torch.optim.SGD(module.parameters(), lr=0.01, momentum=0.9)
            if kind == "built-in":
                return TorchModel(module, optimizer, F.cross_entropy, device="cpu")
            if kind == "own (function)":
                return TorchModel(module, optimizer, training_step=own, device="cpu")
            if kind == "own (subclass)":
                return Subclass(module, optimizer, device="cpu")
            if kind == "own (manual)":
                return TorchModel(
                    module, optimizer, training_step=manual, automatic_optimization=False, device="cpu"
                )
            return module, optimizer

        return make

    return {
        kind: made(kind)
        for kind in ("built-in", "own (function)", "own (subclass)", "own (manual)", "raw loop")
    }


def timed(kind: str, made: Any, data: list[Any], epochs: int) -> float:
    """CPU seconds per step of one run."""
    if kind == "raw loop":
        module, optimizer = made
        start = time.process_time()
        for _ in range(epochs):
            module.train()
            for x, y in data:
                optimizer.zero_grad(set_to_none=True)
                F.cross_entropy(module(x), y).backward()
                optimizer.step()
        return (time.process_time() - start) / (epochs * len(data))
    loop = Loop(made, {"train": data}, plugins={}, max_epochs=epochs)
    start = time.process_time()
    loop.run()
    return (time.process_time() - start) / (epochs * len(data))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=rounds, default=9)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--width", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(1)
    data = batches(args.steps, args.width)
    makers = cases(args.width)
    names = list(makers)
    for name in names:  # warm-up: one short run each
        timed(name, makers[name](), data[:20], 1)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            times[name].append(timed(name, makers[name](), data, args.epochs))
    base = times["built-in"]
    print(
        f"torch {torch.__version__}, MLP {args.width}-{args.width}-10, batch 32, {args.steps} steps x "
        f"{args.epochs} epochs, {args.rounds} interleaved rounds, process CPU time, 1 thread"
    )
    print(f"{'case':<16} {'median/step':>12} {'ratio to built-in (median, min-max)':>38} {'fastest':>8}")
    for name in names:
        ratios = [t / b for t, b in zip(times[name], base, strict=True)]
        median = statistics.median(times[name]) * 1e6
        spread = f"{statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})"
        print(f"{name:<16} {median:>10.1f}us {spread:>38} {min(times[name]) / min(base):>8.3f}")


if __name__ == "__main__":
    main()
