"""Asynchronous saves under back-pressure: a periodic save due while the previous write is still
running is deferred to the first batch end after it, never waited for; end saves always wait."""

from __future__ import annotations

import threading
import warnings
from pathlib import Path
from typing import Any

import pytest
from epochal_checkpoint import Checkpoint, list_checkpoints, load_latest, storage
from epochal_checkpoint.testing import make_data, make_model

from epochal import Loop, hookimpl


class SlowDisk:
    """Stands in for a disk slower than the loop: the first write blocks until released."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.release = threading.Event()
        self.started = threading.Event()
        self.writes: list[str] = []
        real = storage.write_checkpoint

        def write_checkpoint(directory: Path, name: str, *args: Any, **kwargs: Any) -> Any:
            if not self.writes:
                self.started.set()
                self.release.wait(timeout=60)  # released by the loop, batches later
            self.writes.append(name)
            return real(directory, name, *args, **kwargs)

        monkeypatch.setattr(storage, "write_checkpoint", write_checkpoint)


class ReleaseAt:
    """Releases the blocked write at iteration *at*: the loop reached it while the write hung."""

    def __init__(self, disk: SlowDisk, plugin: Checkpoint, at: int) -> None:
        self.disk, self.plugin, self.at = disk, plugin, at
        self.reached_while_blocked = False

    @hookimpl
    def after_batch(self, loop: Any) -> None:
        if loop.iteration == self.at:
            self.reached_while_blocked = self.disk.started.is_set() and not self.disk.writes
            self.disk.release.set()
            self.plugin.wait()  # the write finishes here: the checkpoint finds its writer idle


def test_a_save_due_while_writing_is_deferred_not_waited_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    disk = SlowDisk(monkeypatch)
    plugin = Checkpoint(every_n_batches=1, every_n_epochs=0, keep_last=None, async_save=True)
    release = ReleaseAt(disk, plugin, at=8)
    loop = Loop(
        make_model(1000),
        make_data(),
        plugins={"release": release, "checkpoint": plugin},
        max_iterations=12,
        seed=0,
        run_dir=tmp_path,
        handle_signals=False,
    )
    with pytest.warns(RuntimeWarning, match=r"deferred to the first batch end") as warned:
        loop.run()
    assert len([w for w in warned if "deferred" in str(w.message)]) == 1  # said once per run
    # batches 2..8 ran while the first write hung: the loop never waited for it
    assert release.reached_while_blocked
    # the saves due at batches 2..7 were coalesced into the one at 8 (and the saves due while
    # that one and later ones were written, some of 9..11: a write takes longer than a batch)
    assert plugin.deferred >= 6
    written = [info.manifest["iteration"] for info in list_checkpoints(tmp_path / "checkpoints")[0]]
    assert written[:2] == [1, 8] and written[-1] == 12, written
    state, info = load_latest(tmp_path / "checkpoints")  # the end save waited and was written
    assert state["iteration"] == 12 and info.manifest["deferred_saves"] == plugin.deferred


def test_end_and_interrupt_saves_wait_for_the_write_in_flight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    disk = SlowDisk(monkeypatch)
    plugin = Checkpoint(every_n_batches=3, every_n_epochs=0, async_save=True)

    class Release:
        @hookimpl
        def after_training(self, loop: Any) -> None:  # ordered before checkpoint: still blocked
            disk.release.set()

    loop = Loop(
        make_model(1000),
        make_data(),
        plugins={"release": Release(), "checkpoint": plugin},
        max_iterations=4,
        seed=0,
        run_dir=tmp_path,
        handle_signals=False,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no save was deferred: none came due during the write
        loop.run()
    assert disk.writes == ["ckpt-e0000-i000003", "ckpt-e0000-i000004"] and plugin.deferred == 0
    assert load_latest(tmp_path / "checkpoints")[0]["iteration"] == 4


def test_an_epoch_end_save_waits_for_the_write_and_stays_an_epoch_end_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 44, item 6: deferred one batch, it was a mid-epoch checkpoint (only the same number
    of processes resumes it), and a run could be left without any epoch-end checkpoint."""
    disk = SlowDisk(monkeypatch)
    plugin = Checkpoint(every_n_batches=3, every_n_epochs=1, keep_last=None, async_save=True)

    class ReleaseLater:
        """Releases the first write (taken at batch 3) a moment after the epoch end waits for it."""

        @hookimpl
        def after_epoch(self, loop: Any) -> None:
            threading.Timer(0.2, disk.release.set).start()

    loop = Loop(
        make_model(1000),
        make_data(examples=128, batch_size=16),  # 8 batches an epoch
        plugins={"release": ReleaseLater(), "checkpoint": plugin},  # the timer starts first
        max_epochs=2,
        seed=0,
        run_dir=tmp_path,
        handle_signals=False,
    )
    loop.run()
    assert plugin.deferred >= 1  # the batch save at 6 came while the first write hung
    saved = {i.manifest["iteration"]: i for i in list_checkpoints(tmp_path / "checkpoints")[0]}
    assert 8 in saved and saved[8].manifest["reason"] == "epoch", sorted(saved)
    state, _ = storage.read_checkpoint(saved[8].path)
    assert state["in_epoch"] is False  # any number of processes resumes it
