"""A save pauses Python's cyclic garbage collector: the containers it makes per array (thousands
for a model of thousands of tensors) are freed when it ends instead of being promoted to the
oldest generation, whose growth triggers full collections of the whole process."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import pytest
from epochal_checkpoint import Checkpoint, list_checkpoints
from epochal_checkpoint.testing import make_data, make_model

from epochal import Loop


def run_watching_saves(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, async_save: bool) -> list[int]:
    """Train 2 epochs of a model of 2,000 arrays, saving each epoch; the generations of the
    collections that started inside a save."""
    inside: list[bool] = []
    save = Checkpoint._take_save  # the save itself, inside the pause

    def watched(self: Checkpoint, *args: Any, **kwargs: Any) -> None:
        inside.append(True)
        try:
            save(self, *args, **kwargs)
        finally:
            inside.pop()

    monkeypatch.setattr(Checkpoint, "_take_save", watched)
    started: list[int] = []

    def callback(phase: str, info: dict[str, int]) -> None:
        if phase == "start" and inside:
            started.append(info["generation"])

    loop = Loop(
        make_model(size=8_000, chunks=2_000),
        make_data(),
        plugins={"checkpoint": Checkpoint(dir=str(tmp_path / "ck"), async_save=async_save)},
        max_epochs=2,
        seed=0,
        run_dir=tmp_path,
        handle_signals=False,
    )
    gc.callbacks.append(callback)
    try:
        loop.run()
    finally:
        gc.callbacks.remove(callback)
    assert len(list_checkpoints(tmp_path / "ck")[0]) == 2  # one per epoch (the end of training is the last)
    return started


@pytest.mark.filterwarnings("ignore:.*came while the previous asynchronous write:RuntimeWarning")
@pytest.mark.parametrize("async_save", [False, True])
def test_no_collection_runs_inside_a_save_and_the_collector_runs_after(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, async_save: bool
) -> None:
    assert gc.isenabled()
    assert run_watching_saves(tmp_path, monkeypatch, async_save) == []
    assert gc.isenabled()


def test_a_collector_the_program_disabled_stays_disabled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gc.disable()
    try:
        assert run_watching_saves(tmp_path, monkeypatch, async_save=False) == []
        assert not gc.isenabled()
    finally:
        gc.enable()
