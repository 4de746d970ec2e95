"""Exact resume: a run stopped at any batch boundary and resumed ends bitwise equal to a straight run.

A 3-epoch run of the digits example (23 batches per epoch, 69 in all), saving every 7 batches,
every epoch and at the end (the stop point: a stop request is honoured after the batch, so the
end-of-training checkpoint is the state at that boundary; stops at multiples of 7 use the
``after_batch`` checkpoint). A recorder plugin (ordered before ``checkpoint``) writes the train
step's outputs, draws from Python's and numpy's global generators and its own counter into
each log row, so the comparison covers the RNG states, the stream position, plugin state and the counters.
Rows and parameters are compared bitwise (``repr`` of floats, ``tobytes`` of arrays).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from epochal_checkpoint import Checkpoint, load_latest

from epochal import Loop, hookimpl
from epochal.examples.digits import make_data, make_model
from epochal.testing import digits_config, epochal_command

BATCHES_PER_EPOCH = 23  # 1438 training examples in batches of 64


class Recorder:
    """Writes outputs, RNG draws and a counter into every row; its counter is resumable state."""

    def __init__(self) -> None:
        self.count = 0

    @hookimpl
    def after_batch(self, loop: Any, outputs: Any) -> None:
        self.count += 1
        row = loop.log.current_row
        row["loss"], row["accuracy"] = outputs["loss"], outputs["accuracy"]
        row["np_draw"], row["py_draw"] = float(np.random.random()), random.random()
        row["count"] = self.count

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.count = state["count"]


class StopAt:
    """Requests a stop after batch *iteration*, or after epoch *epoch* (its end, evaluation done)."""

    def __init__(self, iteration: int | None = None, epoch: int | None = None) -> None:
        self.iteration, self.epoch = iteration, epoch

    @hookimpl
    def after_batch(self, loop: Any) -> None:
        if loop.iteration == self.iteration:
            loop.request_stop("test stop")

    @hookimpl
    def after_epoch(self, loop: Any) -> None:
        if loop.epoch == self.epoch:
            loop.request_stop("test stop")


def run(
    run_dir: Path, stop: StopAt | None = None, resume: bool = False, async_save: bool = False, every: int = 7
) -> Loop:
    plugins: dict[str, object] = {"recorder": Recorder()}
    if stop is not None:
        plugins["stop"] = stop
    plugins["checkpoint"] = Checkpoint(every_n_batches=every, keep_last=2, async_save=async_save)
    loop = Loop(
        make_model(),
        make_data(),
        plugins=plugins,
        max_epochs=3,
        seed=0,
        run_dir=run_dir,
        resume=resume,
        handle_signals=False,
    )
    loop.run()
    return loop


def fingerprint(loop: Loop) -> tuple[dict[str, bytes], str]:
    """Model arrays as bytes (with dtype and shape) and the log rows as exact text."""
    arrays = {
        k: v.dtype.str.encode() + str(v.shape).encode() + v.tobytes()
        for k, v in loop.model.state_dict().items()
    }
    return arrays, repr(list(loop.log.rows()))


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, bytes], str]:
    loop = run(tmp_path_factory.mktemp("straight"))
    assert loop.iteration == 3 * BATCHES_PER_EPOCH and loop.epoch == 3
    rows = dict(loop.log.rows())
    assert len(rows) == 3 * BATCHES_PER_EPOCH and "valid.loss" in rows[BATCHES_PER_EPOCH]
    return fingerprint(loop)


STOPS = {
    "first batch": StopAt(iteration=1),
    "mid epoch 1": StopAt(iteration=11),
    "last batch of epoch 1 (before its end)": StopAt(iteration=BATCHES_PER_EPOCH),
    "end of epoch 1 (after evaluation)": StopAt(epoch=1),
    "first batch of epoch 2": StopAt(iteration=BATCHES_PER_EPOCH + 1),
    "mid epoch 2": StopAt(iteration=35),
    "end of epoch 2": StopAt(epoch=2),
    "last batch of the run": StopAt(iteration=3 * BATCHES_PER_EPOCH),
}


@pytest.mark.parametrize("where", list(STOPS))
def test_resume_at_a_batch_boundary_is_bitwise_exact(
    where: str, tmp_path: Path, straight: tuple[dict[str, bytes], str]
) -> None:
    stopped = run(tmp_path, stop=STOPS[where])
    assert stopped.log.status["finish_reason"] == "test stop"
    resumed = run(tmp_path, resume=True)
    assert resumed.resumed and resumed.resumed_from == stopped.run_id
    assert (resumed.epoch, resumed.iteration) == (3, 3 * BATCHES_PER_EPOCH)
    arrays, rows = fingerprint(resumed)
    assert arrays == straight[0]
    assert rows == straight[1]


@pytest.mark.parametrize("async_save", [False, True])
def test_resume_twice_with_async_saves_is_bitwise_exact(
    async_save: bool, tmp_path: Path, straight: tuple[dict[str, bytes], str]
) -> None:
    run(tmp_path, stop=StopAt(iteration=17), async_save=async_save, every=1)
    run(tmp_path, stop=StopAt(iteration=52), resume=True, async_save=async_save, every=1)
    resumed = run(tmp_path, resume=True, async_save=async_save, every=1)
    assert fingerprint(resumed) == straight
    # keep_last = 2 across the whole lineage of three runs
    kept = sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.name[0] != ".")
    if async_save:  # saves due while a write was in flight were deferred: which ones varies
        assert len(kept) == 3 and kept[1:] == ["ckpt-e0003-i000069", "latest"], kept
        return
    assert kept == [
        "ckpt-e0002-i000069",  # after the last batch (in epoch 3)
        "ckpt-e0003-i000069",  # after epoch 3 ended
        "latest",
    ]


def test_cli_run_interrupted_by_max_iterations_then_resume_matches_straight_run(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    for d in ("a", "b"):
        digits_config(
            tmp_path / d / "run.toml",
            ["checkpoint"],
            max_epochs=3,
            run_dir="run",
            extra="[plugins.checkpoint]\nevery_n_batches = 1\n",
        )
    done = epochal_command("run", "run.toml", cwd=tmp_path / "a")
    assert done.returncode == 0, done.stderr
    cut = epochal_command("run", "run.toml", "--set", "loop.max_iterations=30", cwd=tmp_path / "b")
    assert cut.returncode == 0 and "max_iterations=30" in cut.stdout, cut.stderr
    again = epochal_command("run", "run.toml", "--resume", cwd=tmp_path / "b")
    assert again.returncode == 0, again.stderr
    assert "finished after 3 epoch(s), 69 batch(es)" in again.stdout
    (a, info_a), (b, info_b) = (load_latest(tmp_path / d / "run" / "version_0" / "checkpoints") for d in "ab")
    assert info_a.name == info_b.name == "ckpt-e0003-i000069"
    assert info_a.manifest["resumed_from"] is None and info_b.manifest["resumed_from"] is not None
    for key, array in a["model"].items():
        assert array.tobytes() == b["model"][key].tobytes(), key
    assert repr(a["log"]["rows"]) == repr(b["log"]["rows"])
    python_a, python_b = a["rng"]["python"], b["rng"]["python"]
    assert python_a["state"].dtype == np.uint32 and python_a["state"].tobytes() == python_b["state"].tobytes()
    assert (python_a["version"], python_a["gauss"]) == (python_b["version"], python_b["gauss"])
    assert a["rng"]["numpy"]["keys"].tobytes() == b["rng"]["numpy"]["keys"].tobytes()
