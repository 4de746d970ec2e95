"""A plugin instance used again for a fresh run behaves as a new instance (issue 30).

Keras resets its callbacks' state on every ``fit`` (``test_state_reset_across_fit_calls``):
``es = EarlyStopping(); Loop(m1, d, plugins={"early_stopping": es}).run(); Loop(m2, d,
plugins={"early_stopping": es}).run()`` must not carry m1's best, patience or weights into the
second run. Only a resume restores a plugin's state. For every standard plugin installed: one
instance runs a fresh run, a resumed run (its state loaded, then trained on), then a fresh run
again; that last run's log, status, output, warnings and files equal those of the same run with
a new instance.
"""

from __future__ import annotations

import json
import math
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from epochal import Loop, load_plugins
from epochal.examples.tiny import TinyModel, tiny_data
from epochal.testing import ResumeFrom

pytestmark = pytest.mark.usefixtures("no_epochal_env")
pytest_plugins = ["epochal.testing"]


def _elapsed_used_up(state: dict[str, Any]) -> None:
    state["elapsed"] = 1000.0  # the saved runs trained 1000 s: a 500 s limit is reached


def _best_of_zero(state: dict[str, Any]) -> None:
    state["best"], state["best_epoch"] = 0.0, 1  # nothing a fresh run logs can beat it


def _checkpoints(run_dir: Path, loop: Loop) -> Any:
    """The files the run's checkpoints are made of (names hold epochs, iterations, sequences)."""
    return sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*"))


def _database(run_dir: Path, loop: Loop) -> Any:
    """What the database holds of the run: its records and what its runs table says."""
    from epochal_sqlite.store import Reader

    with Reader(run_dir.parent / "epochal.sqlite") as db:
        run = db.get(loop.run_id)
        assert run is not None
        records = list(db.records(loop.run_id))
    kept = ("status", "finish_reason", "epochs_done", "iterations_done", "start_iteration", "resumed_from")
    return [records, {k: getattr(run, k) for k in kept}]


@dataclass
class Case:
    module: str  # the plugin's distribution's import name
    options: dict[str, Any] = field(default_factory=dict)
    #: a change to its saved state that makes a state kept by mistake show in the fresh run
    tamper: Callable[[dict[str, Any]], None] | None = None
    #: what the run wrote outside the log, besides: (run_dir, loop) -> comparable data
    written: Callable[[Path, Loop], Any] | None = None
    #: the epochs a run resumed at epoch 1 for 5 epochs ends after (the tampered state shows)
    resumed_until: int = 5


CASES: dict[str, Case] = {
    "early_stopping": Case(
        "epochal_earlystop", {"patience": 1, "restore_best": True}, _best_of_zero, resumed_until=2
    ),
    "finish_after": Case("epochal_earlystop", {"seconds": 500.0}, _elapsed_used_up, resumed_until=1),
    "lr_scheduler": Case(
        "epochal_schedule",
        {"name": "StepLR", "step_size": 1, "gamma": 0.5, "interval": "batch", "frequency": 3},
    ),
    "monitor": Case("epochal_monitor", {"every_n_batches": 3}),
    "timing": Case("epochal_timing"),
    "progress": Case("epochal_progress", {"force": True, "mininterval": 1e6, "leave": True}),
    "printing": Case("epochal_printing", {"tty": True, "batches": 3}),
    "checkpoint": Case("epochal_checkpoint", {"every_n_batches": 5, "keep_last": 2}, written=_checkpoints),
    "sqlite_log": Case("epochal_sqlite", written=_database),
}


class OddModel(TinyModel):
    """TinyModel whose step outputs a NaN ``odd`` metric in every 5th step (warned once a run)."""

    def __init__(self) -> None:
        super().__init__(seed=0)
        self.steps = 0

    def train_step(self, batch: Any) -> dict[str, float]:
        out = super().train_step(batch)
        self.steps += 1
        out["odd"] = math.nan if self.steps % 5 == 0 else 1.0
        return out


def _plugin(name: str) -> Any:
    pytest.importorskip(CASES[name].module)
    return load_plugins(order=[name], autoload=False, options={name: CASES[name].options}).plugins[name]


def _run(plugin: Any, name: str, run_dir: Path, max_epochs: int, resume: Any = None) -> tuple[Loop, str]:
    plugins = {name: plugin}
    if resume is not None:
        plugins["resume"] = ResumeFrom(resume)
    loop = Loop(
        OddModel(), tiny_data(), plugins=plugins, seed=0, max_epochs=max_epochs,
        run_dir=run_dir, handle_signals=False,
    )  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loop.run()
    return loop, json.dumps([str(w.message) for w in caught])


def _observed(name: str, loop: Loop, warned: str, output: str, run_dir: Path) -> str:
    """The run's log rows, status, output and warnings, without what differs between any two runs
    (times, run ids, directories)."""
    rows = [
        (i, {k: None if k.startswith("timing.") else v for k, v in row.items()}) for i, row in loop.log.rows()
    ]
    status = dict(loop.log.status)
    status.pop("run_id", None)
    if isinstance(status.get("timing"), dict):  # seconds vary, calls do not
        status["timing"] = {k: v["calls"] for k, v in status["timing"].items() if isinstance(v, dict)}
    written = CASES[name].written
    files = written(run_dir, loop) if written is not None else None
    text = json.dumps([rows, status, output, warned, files], sort_keys=True, default=repr)
    text = text.replace(loop.run_id, "<run>").replace(str(run_dir), "<dir>")
    text = re.sub(r"\[\d\d:\d\d[^\]]*\]", "[<time>]", text)  # a bar's elapsed time and rate
    return re.sub(r"\d+(\.\d+)?(s|ms|µs)\b", "<seconds>", text)  # an epoch's time: 1.2s, 42ms


@pytest.mark.parametrize("name", list(CASES))
def test_a_fresh_run_with_a_used_instance_is_a_fresh_run(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    saver, _ = _run(_plugin(name), name, tmp_path / "saved", max_epochs=1)
    saved = saver.state_dict()
    tamper = CASES[name].tamper
    if tamper is not None:
        tamper(saved["plugins"][name]["state"])
    used = _plugin(name)
    _run(used, name, tmp_path / "before", max_epochs=2)
    # the same instance resumes: the loaded state wins over the one of its earlier run
    resumed, _ = _run(used, name, tmp_path / "resumed", max_epochs=5, resume=saved)
    assert resumed.resumed and resumed.epoch == CASES[name].resumed_until
    capsys.readouterr()

    again, warned = _run(used, name, tmp_path / "again", max_epochs=3)
    output = capsys.readouterr()
    assert not again.resumed
    new, new_warned = _run(_plugin(name), name, tmp_path / "new", max_epochs=3)
    new_output = capsys.readouterr()
    assert again.epoch == new.epoch == 3
    assert _observed(name, again, warned, output.out + output.err, tmp_path / "again") == _observed(
        name, new, new_warned, new_output.out + new_output.err, tmp_path / "new"
    )
