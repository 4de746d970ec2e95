"""The training log in segments: a save writes only the rows new or changed since the previous one.

Runs of the synthetic model (16 batches per epoch) with a plugin writing a record every batch;
the checkpoints are inspected on disk (segment files, their rows, inodes) and read back through
the public readers; resumed runs are compared bitwise with straight runs.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from epochal_checkpoint import (
    Checkpoint,
    CorruptCheckpointError,
    Load,
    incremental,
    list_checkpoints,
    load_latest,
    read_checkpoint,
)
from epochal_checkpoint.storage.load import read_state_document
from epochal_checkpoint.testing import BatchRecorder, make_data, make_model, resign

from epochal import Loop, hookimpl


@pytest.fixture(autouse=True)
def every_save_writes_a_segment(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests look at segments: no rows kept in the state while few (see the last tests)."""
    monkeypatch.setattr(incremental, "INLINE_VALUES", 0)


class Edits:
    """At iteration *at*, rewrites rows saved earlier: a changed value, a removed key, an emptied
    row, a list grown in place; at iteration 9 writes a list value (row 8) and a nested numpy
    value (row 9)."""

    def __init__(self, at: int = 20) -> None:
        self.at = at

    @hookimpl
    def after_batch(self, loop: Any) -> None:
        log = loop.log
        if loop.iteration == 9:
            log[8]["hist"] = [1]
            log[9]["nested"] = {"x": np.float32(1.5)}  # not plain JSON: kept in state.json
        if loop.iteration == self.at:
            log[5]["loss"] = 123.0
            del log[6]["step"]
            log[7].clear()
            log[8]["hist"].append(2)


class KeepUp:
    """Waits for the checkpoint's write in flight at every batch end, before the checkpoint's
    hook: a disk that keeps up with the loop, so every asynchronous save is taken when due (none
    deferred by back-pressure, whatever the machine's load)."""

    def __init__(self, checkpoint: Checkpoint) -> None:
        self.checkpoint = checkpoint

    @hookimpl
    def after_batch(self, loop: Any) -> None:
        self.checkpoint.wait()


def run(
    run_dir: Path,
    max_iterations: int,
    every: int = 10,
    resume: bool = False,
    edits: Edits | None = None,
    keep_up: bool = False,
    **options: Any,
) -> Loop:
    plugins: dict[str, object] = {"recorder": BatchRecorder()}
    if edits is not None:
        plugins["edits"] = edits
    options = {"every_n_epochs": 0, "save_at_end": False, "keep_last": None, **options}
    checkpoint = Checkpoint(every_n_batches=every, **options)
    if keep_up:
        plugins["keep_up"] = KeepUp(checkpoint)
    plugins["checkpoint"] = checkpoint
    loop = Loop(
        make_model(size=1000),
        make_data(),
        plugins=plugins,
        max_iterations=max_iterations,
        seed=0,
        run_dir=run_dir,
        resume=resume,
        handle_signals=False,
    )
    loop.run()
    return loop


def manifest(path: Path) -> dict[str, Any]:
    return json.loads((path / "manifest.json").read_text())


def segment_rows(path: Path, name: str) -> dict[str, Any]:
    return json.loads((path / name).read_text())["rows"]


def rows_text(rows: Any) -> str:
    return repr(rows)


def test_a_record_every_batch_writes_only_the_new_rows_per_save(tmp_path: Path) -> None:
    loop = run(tmp_path, max_iterations=60, every=10)
    infos, _ = list_checkpoints(tmp_path / "checkpoints")
    assert [info.manifest["iteration"] for info in infos] == [10, 20, 30, 40, 50, 60]
    for before, after in itertools.pairwise(infos):
        old, new = before.manifest["log_segments"], after.manifest["log_segments"]
        assert new[:-1] == old  # every segment of the previous checkpoint, then one new segment
        for name in old:  # linked, not re-encoded: the same file (hard link)
            assert os.stat(before.path / name).st_ino == os.stat(after.path / name).st_ino
            assert after.manifest["files"][name] == before.manifest["files"][name]
        start, stop = before.manifest["iteration"], after.manifest["iteration"]
        added = segment_rows(after.path, new[-1])
        assert list(added) == [str(i) for i in range(start + 1, stop + 1)]
        assert after.manifest["files"][new[-1]]["size"] == (after.path / new[-1]).stat().st_size
        assert read_state_document(after.path)["tree"]["log"]["rows"] == {}
    state, _ = read_checkpoint(infos[-1].path)
    assert rows_text(state["log"]["rows"]) == rows_text(loop.log.state_dict()["rows"])
    status = read_state_document(infos[-1].path)["tree"]["log"]["status"]
    assert status["status"] == "running" == state["log"]["status"]["status"]  # in the state


def test_many_saves_keep_few_segments_and_the_log_exact(tmp_path: Path) -> None:
    loop = run(tmp_path, max_iterations=300, every=1, keep_last=2)
    infos, _ = list_checkpoints(tmp_path / "checkpoints")
    newest = infos[-1]
    assert len(newest.manifest["log_segments"]) <= 7 * 3  # FANOUT - 1 per size class
    state, _ = read_checkpoint(newest.path)
    assert rows_text(state["log"]["rows"]) == rows_text(loop.log.state_dict()["rows"])


@pytest.mark.parametrize("async_save", [False, True])
def test_a_row_changed_after_it_was_saved_is_saved_again_and_resumed(
    tmp_path: Path, async_save: bool
) -> None:
    loop = run(tmp_path / "a", max_iterations=20, edits=Edits(at=20), async_save=async_save)
    directory = tmp_path / "a" / "checkpoints"
    first, second = list_checkpoints(directory)[0]
    new = segment_rows(second.path, second.manifest["log_segments"][-1])
    assert new["5"]["loss"] == 123.0 and "step" not in new["6"] and new["7"] == {}
    inline = read_state_document(second.path)["tree"]["log"]["rows"]
    assert "9" not in new and list(inline) == ["9"]  # a nested numpy value: the row stays in the state
    assert new["8"]["hist"] == [1, 2]  # grown in place after it was saved: saved again
    state, _ = read_checkpoint(second.path)
    rows = state["log"]["rows"]
    assert rows["5"]["loss"] == 123.0 and "step" not in rows["6"] and "7" not in rows
    assert rows["8"]["hist"] == [1, 2] and type(rows["9"]["nested"]["x"]) is np.float32
    assert rows_text(rows) == rows_text(loop.log.state_dict()["rows"])
    earlier, _ = read_checkpoint(first.path)  # the first checkpoint still holds the old values
    assert earlier["log"]["rows"]["5"]["loss"] != 123.0 and "7" in earlier["log"]["rows"]
    assert earlier["log"]["rows"]["8"]["hist"] == [1]
    # resume from the second checkpoint and go on: bitwise equal to a straight run
    resumed = run(tmp_path / "a", max_iterations=40, resume=True, edits=Edits(at=20), async_save=async_save)
    assert resumed.log[5]["loss"] == 123.0 and 7 not in dict(resumed.log.rows())
    straight = run(tmp_path / "b", max_iterations=40, edits=Edits(at=20), async_save=async_save)
    assert rows_text(resumed.log.state_dict()["rows"]) == rows_text(straight.log.state_dict()["rows"])
    assert all(
        resumed.model.params[k].tobytes() == straight.model.params[k].tobytes() for k in straight.model.params
    )
    # the resumed run linked the segments of the checkpoint it resumed from
    infos, _ = list_checkpoints(directory)
    after_resume = infos[2]
    for name in second.manifest["log_segments"]:
        if name in after_resume.manifest["log_segments"]:
            assert os.stat(second.path / name).st_ino == os.stat(after_resume.path / name).st_ino
    assert set(second.manifest["log_segments"]) & set(after_resume.manifest["log_segments"])
    state, _ = read_checkpoint(infos[-1].path)
    assert rows_text(state["log"]["rows"]) == rows_text(straight.log.state_dict()["rows"])


def test_retention_leaves_the_newest_complete_and_self_contained(tmp_path: Path) -> None:
    loop = run(tmp_path, max_iterations=50, every=10, keep_last=1)
    infos, _ = list_checkpoints(tmp_path / "checkpoints")
    assert len(infos) == 1
    newest = infos[0]
    segments = newest.manifest["log_segments"]
    assert len(segments) == 5  # written by the 5 saves, the 4 older checkpoints deleted
    assert all((newest.path / name).stat().st_nlink == 1 for name in segments)
    state, _ = read_checkpoint(newest.path)
    expected = rows_text(loop.log.state_dict()["rows"])
    assert rows_text(state["log"]["rows"]) == expected
    moved = tmp_path / "elsewhere" / newest.name  # a checkpoint directory alone is enough
    shutil.copytree(newest.path, moved)
    shutil.rmtree(tmp_path / "checkpoints")
    load = Load(path=str(moved))
    loaded = Loop(
        make_model(size=1000),
        make_data(),
        plugins={"load": load},
        max_iterations=50,
        seed=0,
        handle_signals=False,
    )
    loaded.run()
    assert load.loaded == moved and rows_text(loaded.log.state_dict()["rows"]) == expected


@pytest.mark.parametrize("which", ["shared by every checkpoint", "newest only"])
def test_a_damaged_log_segment_costs_only_its_rows(tmp_path: Path, which: str) -> None:
    run(tmp_path, max_iterations=30, every=10)
    directory = tmp_path / "checkpoints"
    first, _, third = list_checkpoints(directory)[0]
    name = (
        first.manifest["log_segments"][0]
        if which.startswith("shared")
        else third.manifest["log_segments"][-1]
    )
    lost = set(segment_rows(third.path, name))
    with open(third.path / name, "r+b") as file:  # in place: every hard link sees it
        file.seek(40)
        byte = file.read(1)
        file.seek(40)
        file.write(bytes([byte[0] ^ 0x01]))
    with pytest.warns(RuntimeWarning) as warned:
        state, info = load_latest(directory)
    # the newest checkpoint is used: model, counters and RNG intact, only those rows missing
    assert info.name == third.name and state["iteration"] == 30
    assert lost and not lost & set(map(str, state["log"]["rows"]))
    messages = [str(w.message) for w in warned]
    assert len(messages) == 1 and f"{name} fails its checksum" in messages[0], messages
    assert "rows" in messages[0] and "are lost" in messages[0]
    # --resume continues from it, bitwise on the model; the next save writes intact segments
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        resumed = run(tmp_path, max_iterations=40, every=10, resume=True)
    straight = run(tmp_path / "straight", max_iterations=40, every=10)
    for key, array in straight.model.state_dict().items():
        assert np.array_equal(resumed.model.state_dict()[key], array), key
    rows = resumed.log.state_dict()["rows"]
    assert sorted(map(int, rows)) == sorted(set(range(1, 41)) - set(map(int, lost)))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        state, info = load_latest(directory)
    assert info.manifest["iteration"] == 40 and name not in info.manifest["log_segments"]


def test_segments_are_copied_when_hard_links_fail(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_link(source: Any, target: Any) -> None:
        raise PermissionError(1, "Operation not permitted", str(source))

    monkeypatch.setattr(os, "link", no_link)
    loop = run(tmp_path, max_iterations=30, every=10)
    first, _, third = list_checkpoints(tmp_path / "checkpoints")[0]
    name = first.manifest["log_segments"][0]
    assert os.stat(first.path / name).st_ino != os.stat(third.path / name).st_ino
    assert (first.path / name).read_bytes() == (third.path / name).read_bytes()
    state, _ = read_checkpoint(third.path)
    assert rows_text(state["log"]["rows"]) == rows_text(loop.log.state_dict()["rows"])


@pytest.mark.parametrize("bad", ["../state.json", "log-1-i1-1.json/../../x", "state.json"])
def test_a_manifest_naming_a_bad_segment_is_refused(tmp_path: Path, bad: str) -> None:
    run(tmp_path, max_iterations=10, every=10)
    path = list_checkpoints(tmp_path / "checkpoints")[0][0].path
    document = manifest(path)
    document["log_segments"] = [bad]
    resign(path, document)
    with pytest.raises(CorruptCheckpointError, match="log_segments"):
        read_checkpoint(path)


def test_the_log_accessors_the_incremental_save_relies_on() -> None:

    from epochal.log import TrainingLog

    log = TrainingLog()
    log[3]["a"] = np.float32(0.5)
    log[1]["b"] = 1
    view = log.row_map
    assert list(view) == [3, 1] and view[3] is log[3]  # creation order, live rows, no copy
    with pytest.raises(TypeError):
        view[5] = {}  # type: ignore[index,unused-ignore]
    full = log.state_dict()
    assert full["rows"] == {"1": {"b": 1}, "3": {"a": 0.5}}
    assert log.state_dict(rows=False) == {"rows": {}, "status": full["status"]}
    assert log.state_dict() == full and log.load_count == 0
    log.load_state_dict(full)
    assert log.load_count == 1 and list(log.row_map) == [1, 3]


def test_a_long_log_is_merged_on_disk_and_never_read_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """40,000 rows, a save every 500: segments are merged into ones of 4,000 and 32,000 rows by
    copying their bytes (the log is never asked for a saved row again), the count stays small."""
    from epochal.log import TrainingLog

    real_peek = TrainingLog.peek

    def peek(self: TrainingLog, iterations: Any) -> Any:
        wanted = list(iterations)
        assert not wanted, f"the log was asked for {len(wanted)} saved rows"
        return real_peek(self, wanted)

    monkeypatch.setattr(TrainingLog, "peek", peek)
    loop = run(tmp_path, max_iterations=40_000, every=500, keep_last=2)
    newest = list_checkpoints(tmp_path / "checkpoints")[0][-1]
    segments = newest.manifest["log_segments"]
    sizes = [len(segment_rows(newest.path, name)) for name in segments]
    assert len(segments) <= 7 * 3 and max(sizes) >= 32_000, sizes  # past the former 4,096-row limit
    state, _ = read_checkpoint(newest.path)
    saved, final = state["log"]["rows"], loop.log.state_dict()["rows"]
    # the run's last batch ends an epoch: its evaluation comes after the batch's save (and
    # save_at_end is off), so the last row gains the epoch's records after the checkpoint
    last = max(final, key=int)
    assert {k: v for k, v in final[last].items() if k not in ("epochs_done", "valid.loss")} == saved[last]
    assert rows_text({k: v for k, v in saved.items() if k != last}) == rows_text(
        {k: v for k, v in final.items() if k != last}
    )


def test_few_new_rows_stay_in_the_state_until_enough_gathered_for_a_segment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While the rows new since the last segment hold at most ``INLINE_VALUES`` values (a row
    counting one more), they stay in the state: the checkpoint is two files; then one segment
    takes them all. Every checkpoint holds every row, and a resume from one whose rows are all in
    the state equals a straight run."""
    monkeypatch.setattr(incremental, "INLINE_VALUES", 100)
    straight = run(tmp_path / "a", max_iterations=60, every=10)
    infos, _ = list_checkpoints(tmp_path / "a" / "checkpoints")
    first = infos[0]
    assert sorted(p.name for p in first.path.iterdir()) == ["data.bin", "manifest.json"]
    assert "log_segments" not in first.manifest and set(first.manifest["files"]) == {"data.bin"}
    assert list(read_state_document(first.path)["tree"]["log"]["rows"]) == [str(i) for i in range(1, 11)]
    assert any(info.manifest.get("log_segments") for info in infos)  # once enough had gathered
    for info in infos:
        inline = read_state_document(info.path)["tree"]["log"]["rows"]
        assert sum(len(row) + 1 for row in inline.values()) <= 100
        names = info.manifest.get("log_segments", [])
        on_disk = set().union(*(segment_rows(info.path, name) for name in names))
        assert on_disk | set(inline) == {str(i) for i in range(1, info.manifest["iteration"] + 1)}
    state, _ = read_checkpoint(infos[-1].path)
    assert rows_text(state["log"]["rows"]) == rows_text(straight.log.state_dict()["rows"])
    run(tmp_path / "b", max_iterations=20, every=10)
    second = list_checkpoints(tmp_path / "b" / "checkpoints")[0][-1]
    assert (
        second.manifest["iteration"] == 20 and "log_segments" not in second.manifest
    )  # every row of the resumed checkpoint: in the state
    resumed = run(tmp_path / "b", max_iterations=60, every=10, resume=True)
    assert rows_text(resumed.log.state_dict()["rows"]) == rows_text(straight.log.state_dict()["rows"])
    assert all(
        resumed.model.params[k].tobytes() == straight.model.params[k].tobytes() for k in straight.model.params
    )
    newest, _ = read_checkpoint(list_checkpoints(tmp_path / "b" / "checkpoints")[0][-1].path)
    assert rows_text(newest["log"]["rows"]) == rows_text(straight.log.state_dict()["rows"])


@pytest.mark.parametrize("keep_up", [True, False], ids=["every-save-when-due", "saves-deferred-by-load"])
def test_rows_kept_in_the_state_with_asynchronous_saves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, keep_up: bool
) -> None:
    """The same with ``async_save``: the rows in the state are the copies taken at the save.

    Which saves are taken depends on how fast the writer thread is (a save due while the last
    write runs is deferred): with *keep_up* every save is taken when due, so the save at 20
    always follows one (at 10) that kept all rows in the state, and row 7, emptied at 20, must be
    left out as the log leaves it (it was written as ``{}``, a hiding row with nothing to hide,
    only when the writer happened to finish within 10 batches: the test was flaky)."""
    monkeypatch.setattr(incremental, "INLINE_VALUES", 100)
    loop = run(tmp_path, max_iterations=60, every=10, async_save=True, edits=Edits(at=20), keep_up=keep_up)
    infos, _ = list_checkpoints(tmp_path / "checkpoints")
    if keep_up:
        assert [info.manifest["iteration"] for info in infos] == [10, 20, 30, 40, 50, 60]
    assert any("log_segments" not in info.manifest for info in infos)
    for info in infos:  # each holds the log as it was at its save
        state, _ = read_checkpoint(info.path)
        at = info.manifest["iteration"]
        straight = run(tmp_path / f"straight-{at}", max_iterations=at, every=0, edits=Edits(at=20))
        assert rows_text(state["log"]["rows"]) == rows_text(straight.log.state_dict()["rows"])
    state, _ = read_checkpoint(infos[-1].path)
    assert rows_text(state["log"]["rows"]) == rows_text(loop.log.state_dict()["rows"])
