"""How long a resume inside an epoch takes, by the position in the epoch (issue 46, item 4).

The data: ``--files`` jsonl files of ``--rows`` rows ``{"x": [3 floats], "y": float}`` each
(written into a temporary directory), streamed by Hugging Face ``datasets``
(``load_dataset("json", streaming=True)``, one shard per file), in batches of ``--batch``. For a
state saved after batch *k* of the epoch (k at 10 %, 50 % and 90 % of it), the time from a
fresh stream to the first batch after *k* (``load_state_dict`` + the first ``next``), median of
``--rounds`` interleaved rounds, for:

- ``dataset``: the Hugging Face dataset itself (``.batch(n)``), resumed from its state by
  :class:`epochal.stateful.StatefulStream`;
- ``stateful loader``: a torchdata ``StatefulDataLoader`` over it (no workers), the same;
- ``replayed``: a torch ``DataLoader`` over the same rows through an iterable dataset without a
  state (what every iterable dataset did before: the loop's ``LoaderStream`` skips the *k*
  batches already seen).

The stateful columns stay flat (a Hugging Face state goes back at most to the start of the file
it was in); the replayed one grows with *k*. Run: ``python bench/stateful_resume.py`` (needs
``pip install torchdata datasets``).

Figures (2-core shared VM, CPython 3.11, torch 2.13 CPU, datasets 5.2, torchdata 0.11;
16 files × 2,000 rows, batches of 32: 1,000 batches per epoch; medians of 3 rounds, seconds):

========  =======  ===============  ========
position  dataset  stateful loader  replayed
========  =======  ===============  ========
100       0.006    0.008            0.096
500       0.009    0.009            0.603
900       0.009    0.009            0.883
========  =======  ===============  ========

Resumed from their state, 9 ms at 10 %, 50 % and 90 % of the epoch (the time to read on from
the file it was in); replayed, 0.10 → 0.60 → 0.88 s, ~1 ms per batch already seen: 100× the
stateful resume at 90 %, and growing with the epoch (a multi-terabyte stream: hours).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np


def write_files(directory: Path, files: int, rows: int) -> list[str]:
    rng = np.random.default_rng(0)
    paths = []
    for f in range(files):
        x = rng.normal(size=(rows, 3))
        lines = [json.dumps({"x": xi.tolist(), "y": float(xi.sum())}) for xi in x]
        path = directory / f"part-{f:03d}.jsonl"
        path.write_text("\n".join(lines) + "\n")
        paths.append(str(path))
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=16)
    parser.add_argument("--rows", type=int, default=2000)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
        os.environ.setdefault("HF_HOME", str(Path(tmp) / "hf"))
        import torch
        from datasets import load_dataset
        from torchdata.stateful_dataloader import StatefulDataLoader

        from epochal.adapters import adapt_stream

        paths = write_files(Path(tmp), args.files, args.rows)

        def streaming() -> Any:
            return load_dataset("json", data_files=paths, split="train", streaming=True)

        class Plain(torch.utils.data.IterableDataset):
            """The same rows through an iterable dataset without a state of its own."""

            def __iter__(self) -> Any:
                return iter(streaming())

        def collate(rows: list[dict[str, Any]]) -> Any:
            return torch.tensor([r["x"] for r in rows]), torch.tensor([r["y"] for r in rows])

        makers: dict[str, Callable[[], Any]] = {
            "dataset": lambda: adapt_stream(streaming().batch(args.batch), 0, "train"),
            "stateful loader": lambda: adapt_stream(
                StatefulDataLoader(streaming(), args.batch, collate_fn=collate), 0, "train"
            ),
            "replayed": lambda: adapt_stream(
                torch.utils.data.DataLoader(Plain(), args.batch, collate_fn=collate), 0, "train"
            ),
        }
        batches = args.files * args.rows // args.batch
        positions = [batches // 10, batches // 2, batches * 9 // 10]
        states: dict[tuple[str, int], Any] = {}
        for name, make in makers.items():  # the states to resume from, saved as the loop saves them
            for k in positions:
                stream = make()
                iterator = iter(stream)
                for _ in range(k):
                    next(iterator)
                states[name, k] = stream.state_dict()
                del iterator
        times: dict[tuple[str, int], list[float]] = {key: [] for key in states}
        for _ in range(args.rounds):
            for (name, k), state in states.items():
                stream = makers[name]()
                started = time.perf_counter()
                stream.load_state_dict(state)
                next(iter(stream))
                times[name, k].append(time.perf_counter() - started)
        print(f"{args.files} files x {args.rows} rows, batches of {args.batch}: {batches} per epoch")
        print(f"{'position':>8}  " + "  ".join(f"{name:>15}" for name in makers))
        for k in positions:
            cells = [f"{statistics.median(times[name, k]):15.3f}" for name in makers]
            print(f"{k:>8}  " + "  ".join(cells))


if __name__ == "__main__":
    main()
