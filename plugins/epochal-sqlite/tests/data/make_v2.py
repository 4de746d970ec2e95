"""Write ``v2.sqlite``: a log of schema version 2, for the migration test.

Run with epochal-sqlite of schema version 2 installed (main at 047f46f, before version 3)::

    python make_v2.py v2.sqlite

Two runs: A (3 epochs of 3 batches, flushing every 2 rows) saves its state after epoch 1; B
resumes from it, so A's rows past iteration 3 are superseded. Records of every kind: floats,
ints, ints beyond 2**53, booleans, text, lists, NaN and -inf.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

from epochal_sqlite import SQLiteLog, store

from epochal import Loop, hookimpl
from epochal.testing import ResumeFrom

assert store.SCHEMA_VERSION == 2


class Model:
    def __init__(self) -> None:
        self.t = 0

    def train_step(self, batch: Any) -> dict[str, float]:
        self.t += 1
        return {"loss": 1.0 / self.t}

    def eval_step(self, batch: Any) -> dict[str, float]:
        return {"loss": 0.5}

    def state_dict(self) -> dict[str, Any]:
        return {"t": self.t}

    def load_state_dict(self, state: Any) -> None:
        self.t = int(state["t"])


class Extra:
    @hookimpl
    def after_batch(self, loop: Loop) -> None:
        row = loop.log.current_row
        row["note"] = f"step {loop.iteration}"
        row["train.loss"] = 1.0 / loop.iteration
        row["int"] = loop.iteration * 10
        row["big"] = 2**60 + loop.iteration
        row["flag"] = loop.iteration % 2 == 0
        row["vec"] = [loop.iteration, 0.5]
        if loop.iteration % 3 == 0:
            row["nan"] = math.nan
            row["inf"] = -math.inf


saved: dict[str, Any] = {}


class Save:
    @hookimpl
    def after_epoch(self, loop: Loop) -> None:
        if loop.epoch == 1:
            saved["state"] = loop.state_dict()


def main() -> None:
    db = Path(sys.argv[1])
    data = {"train": [[1], [2], [3]], "valid": [[1]]}
    plugins = {"extra": Extra(), "save": Save(), "sqlite_log": SQLiteLog(path=str(db), flush_every=2)}
    Loop(Model(), data, plugins=plugins, max_epochs=3, handle_signals=False).run()
    plugins = {"resume": ResumeFrom(saved["state"]), "extra": Extra(), "sqlite_log": SQLiteLog(path=str(db))}
    Loop(Model(), data, plugins=plugins, max_epochs=4, handle_signals=False).run()


if __name__ == "__main__":
    main()
