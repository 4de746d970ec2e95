"""Peak host memory per rank when a model of >= 1 GB starts under FSDP on 2 processes (issue 46).

What is measured: ``epochal run --nproc 2`` (gloo, one CPU thread per process) of a
``[model]`` factory that builds a stack of ``BLOCKS`` ``Linear(WIDTH, WIDTH)`` layers (16 of
4096: 1.07 GB of float32 parameters) and trains it one batch with ``strategy = "fsdp"`` (each
layer an FSDP unit, SGD). Each rank reads its ``/proc/self/status``: ``VmRSS`` when the factory
starts (torch and epochal imported, the process group joined: the constant), ``VmHWM`` (the peak
resident set, file pages mapped included) when training starts (the module built, sharded,
materialised and loaded) and after the first training batch. Three cases, each its own pair
of processes:

* ``host``: the module built on the host (every rank builds and initialises it whole, then
  FSDP2 shards it: what a factory did before meta-device initialisation);
* ``meta``: built under ``torch.device("meta")``; each rank materialises its shards and
  initialises them (``reset_parameters`` of each layer, on its rows only);
* ``meta+pretrained``: the same, then ``pretrained = "weights.safetensors"`` (the whole model,
  written beforehand): each rank reads only its rows of each tensor.

The figure is the peak above the constant, as a fraction of the full parameter size (a rank's
shard is 0.5 of it on 2 ranks). ``python bench/meta_memory.py``; ``BENCH_BLOCKS``,
``BENCH_WIDTH``, ``BENCH_JSON`` override the defaults.

Measured on the 2-core CPU machine shared with other sessions (torch 2.13 CPU, 2026-12-07;
16 x Linear(4096, 4096) = 1.074 GB = 1024 MiB; the constant when the factory starts: 236 MB on
each rank). Peak above the constant, as a fraction of the full size (both ranks alike within
0.01):

=================  ===============  ===============
case               training starts  after one batch
=================  ===============  ===============
host               1.58x (1616 MB)  1.58x
meta               0.58x (594 MB)   1.28x
meta+pretrained    0.61x (625 MB)   1.28x
=================  ===============  ===============

So a meta module's rank holds its shard (0.50x) plus 0.08x (85 MB: what is imported after the
factory starts, DTensor and DCP, the same with a 2 MB model: the constant), plus 0.03x while it
reads pretrained weights (one tensor's rows, 32 MB, mapped while read); a module built on the
host costs the whole module on every rank, then its shards beside it. After a batch every case
holds its parameter and gradient shards (0.5x each) and one unit gathered.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

BLOCKS = int(os.environ.get("BENCH_BLOCKS", 16))
WIDTH = int(os.environ.get("BENCH_WIDTH", 4096))
CASES = ("host", "meta", "meta+pretrained")
MB = 1 << 20

#: ``VmRSS`` (bytes) when the factory started, in the processes the bench starts.
_START: dict[str, int] = {}


def status() -> dict[str, int]:
    """``VmRSS`` and ``VmHWM`` of this process, in bytes."""
    values = {}
    with open("/proc/self/status", encoding="ascii") as lines:
        for line in lines:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                values[key] = int(value.split()[0]) * 1024
    return values


def stack(blocks: int, width: int) -> Any:
    import torch

    return torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(blocks)))


def make_model(
    meta: bool = False, pretrained: str | None = None, blocks: int = BLOCKS, width: int = WIDTH
) -> Any:
    """The ``[model]`` factory of the runs (in each process)."""
    import torch

    from epochal.torch import TorchModel

    _START["rss"] = status()["VmRSS"]
    torch.set_num_threads(1)
    with torch.device("meta") if meta else torch.device("cpu"):
        net = stack(blocks, width)
    return TorchModel(
        net,
        torch.optim.SGD(net.parameters(), lr=1e-3),
        torch.nn.functional.mse_loss,
        device="cpu",
        strategy="fsdp",
        pretrained=pretrained,
    )


def make_data(width: int = WIDTH) -> dict[str, Any]:
    import numpy as np

    from epochal.data import BatchStream

    x = np.random.default_rng(0).standard_normal((8, width)).astype(np.float32)
    return {"train": BatchStream(x, x, batch_size=4, shuffle=False)}


class Probe:
    """Records each rank's memory when training starts and after the first batch; rank 0
    writes every rank's to *path*."""

    def __init__(self, path: str = "memory.json") -> None:
        self.path = path
        self.seen: dict[str, int] = {}

    def before_training(self, loop: Any) -> None:
        self.seen = {"start": _START["rss"], "ready": status()["VmHWM"]}

    def after_batch(self, loop: Any) -> None:
        self.seen.setdefault("stepped", status()["VmHWM"])

    def after_training(self, loop: Any) -> None:
        every = loop.world.all_gather_object(self.seen)
        if loop.world.is_zero:
            Path(self.path).write_text(json.dumps(every), encoding="utf-8")


def _hooks() -> None:
    from epochal import hookimpl

    for name in ("before_training", "after_batch", "after_training"):
        setattr(Probe, name, hookimpl(getattr(Probe, name)))


_hooks()


def config(directory: Path, case: str) -> Path:
    pretrained = f'pretrained = "{directory / "weights.safetensors"}"' if case == "meta+pretrained" else ""
    path = directory / f"{case}.toml"
    path.write_text(
        f"""[loop]
max_epochs = 1
seed = 0
run_dir = "runs/{case}"

[distributed]
backend = "gloo"
timeout = 600

[model]
factory = "meta_memory:make_model"
meta = {"true" if case.startswith("meta") else "false"}
{pretrained}

[data]
factory = "meta_memory:make_data"

[plugins]
order = ["probe"]
autoload = false

[plugins.probe]
factory = "meta_memory:Probe"
path = "{directory / (case + ".json")}"
""",
        encoding="utf-8",
    )
    return path


def main() -> None:
    full = BLOCKS * (WIDTH * WIDTH + WIDTH) * 4
    results: dict[str, Any] = {"full_bytes": full, "blocks": BLOCKS, "width": WIDTH}
    with tempfile.TemporaryDirectory(prefix="meta-memory-") as tmp:
        directory = Path(tmp)
        import torch
        from safetensors.torch import save_file

        torch.manual_seed(0)
        save_file(stack(BLOCKS, WIDTH).state_dict(), directory / "weights.safetensors")
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent), "OMP_NUM_THREADS": "1"}
        for case in CASES:
            done = subprocess.run(
                [sys.executable, "-m", "epochal", "run", str(config(directory, case)), "--nproc", "2"],
                cwd=directory,
                env=env,
                capture_output=True,
                text=True,
            )
            if done.returncode:
                raise SystemExit(f"{case}: {done.stderr[-3000:]}")
            ranks = json.loads((directory / f"{case}.json").read_text())
            results[case] = ranks
            line = []
            for rank, seen in enumerate(ranks):
                ready = (seen["ready"] - seen["start"]) / full
                stepped = (seen["stepped"] - seen["start"]) / full
                line.append(
                    f"rank {rank}: constant {seen['start'] / MB:.0f} MB, ready +{ready:.2f}x, "
                    f"after a batch +{stepped:.2f}x"
                )
            print(f"{case:16s} " + "; ".join(line), flush=True)
    print(f"full size {full / MB:.0f} MB ({BLOCKS} x Linear({WIDTH}, {WIDTH}))")
    out = os.environ.get("BENCH_JSON")
    if out:
        Path(out).write_text(json.dumps(results, indent=1), encoding="utf-8")


if __name__ == "__main__":
    main()
