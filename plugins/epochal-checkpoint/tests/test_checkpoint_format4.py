"""Format 4: one data file per checkpoint, per-array checksums, older formats still read.

``tests/data/v3`` was written by the plugin of format 3 (before this format) with::

    load_plugins(order=["monitor", "checkpoint"], options={"monitor": {"every_n_batches": 1},
                 "checkpoint": {"every_n_epochs": 1, "keep_last": 2, "dir": ...}})
    Loop(make_model(size=64), make_data(examples=64, batch_size=16), max_epochs=3, seed=0)
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from epochal_checkpoint import (
    CheckpointWriteError,
    CorruptCheckpointError,
    list_checkpoints,
    load_latest,
    read_checkpoint,
    storage,
)
from epochal_checkpoint.storage import flatten, read_pointer, write_checkpoint
from epochal_checkpoint.testing import make_data, make_model

import epochal
from epochal import Loop

FIXTURE = Path(__file__).parent / "data" / "v3"


def fixture_loop(directory: Path, epochs: int, resume: bool = False) -> Loop:
    plugins = epochal.load_plugins(
        order=["monitor", "checkpoint"],
        autoload=False,
        options={
            "monitor": {"every_n_batches": 1},
            "checkpoint": {"every_n_epochs": 1, "keep_last": 2, "dir": str(directory)},
        },
    )
    return Loop(
        make_model(size=64),
        make_data(examples=64, batch_size=16),
        plugins=plugins,
        max_epochs=epochs,
        seed=0,
        handle_signals=False,
        run_dir=str(directory.parent / "run"),
        resume=resume,
    )


def rows_text(rows: dict[str, Any]) -> str:
    return json.dumps({str(k): v for k, v in rows.items()}, sort_keys=True, default=repr)


def test_a_python_generator_state_saved_as_a_list_restores_and_is_saved_as_an_array(tmp_path: Path) -> None:
    # format 3 (and format 4 until Python's state became an array) saved its 625 words as a list
    import random

    from epochal import _rng

    shutil.copytree(FIXTURE, tmp_path / "checkpoints")
    state, _ = load_latest(tmp_path / "checkpoints")
    saved = state["rng"]["python"]
    assert isinstance(saved["state"], list) and len(saved["state"]) == 625
    random.seed(99)
    _rng.restore(state["rng"])
    assert random.getstate() == (saved["version"], tuple(saved["state"]), saved["gauss"])
    words = _rng.capture()["python"]["state"]
    assert words.dtype == np.uint32 and words.tolist() == saved["state"]


def test_a_format_3_directory_written_by_the_previous_plugin_is_read_and_resumed(tmp_path: Path) -> None:
    directory = tmp_path / "checkpoints"
    shutil.copytree(FIXTURE, directory)
    infos, ignored = list_checkpoints(directory)
    assert [i.manifest["version"] for i in infos] == [3, 3] and ignored == []
    assert read_pointer(directory) == "ckpt-e0003-i000012"  # a pointer file of format 3
    state, info = load_latest(directory)
    straight = fixture_loop(tmp_path / "straight" / "checkpoints", 3)
    straight.run()
    for key, array in straight.model.state_dict().items():
        if isinstance(array, np.ndarray):
            assert state["model"][key].tobytes() == array.tobytes(), key
    assert rows_text(state["log"]["rows"]) == rows_text(straight.log.state_dict()["rows"])
    only, _ = read_checkpoint(info.path, model_only=True)
    assert only["model"]["p0"].tobytes() == state["model"]["p0"].tobytes()

    resumed = fixture_loop(directory, 4, resume=True)
    resumed.run()
    longer = fixture_loop(tmp_path / "longer" / "checkpoints", 4)
    longer.run()
    assert rows_text(resumed.log.state_dict()["rows"]) == rows_text(longer.log.state_dict()["rows"])
    newest = list_checkpoints(directory)[0][-1]
    assert newest.manifest["version"] == storage.FORMAT_VERSION == 4
    assert {"data.bin", "manifest.json"} <= {p.name for p in newest.path.iterdir()}
    assert not (newest.path / "arrays.npy").exists() and not (newest.path / "commit").exists()
    linked = newest.manifest["log_segments"][0]  # a segment of the format-3 checkpoint, hard-linked
    assert os.stat(newest.path / linked).st_ino == os.stat(info.path / linked).st_ino
    again, _ = read_checkpoint(newest.path)
    assert rows_text(again["log"]["rows"]) == rows_text(longer.log.state_dict()["rows"])
    assert (directory / "latest").is_symlink() and os.readlink(directory / "latest") == newest.name


def save(directory: Path, state: dict[str, Any], name: str = "ckpt-e0000-i000001") -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    return write_checkpoint(directory, name, flatten(state), {"sequence": 1, "run_id": "r"}).path


def test_model_only_reads_and_checks_only_the_model_arrays(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = {"w": np.arange(1000, dtype=np.float32), "b": np.ones(10)}
    other = {"momentum": np.full(500_000, 3.0), "big": np.zeros(300_000, np.int32)}
    path = save(tmp_path, {"model": model, "optimizer": other, "epoch": 2})
    state = storage.read_state_document(path)
    offset = next(e["offset"] for e in state["arrays"] if e["path"] == ["optimizer", "momentum"])
    with open(path / "data.bin", "r+b") as file:  # damage an optimizer array, checksums untouched
        file.seek(offset + 4096)
        file.write(b"\xff" * 8)
    read: list[int] = []
    real = os.preadv

    def counting(fd: int, buffers: Any, offset: int, *args: Any) -> int:
        n = real(fd, buffers, offset, *args)
        read.append(n)
        return n

    monkeypatch.setattr(os, "preadv", counting)
    loaded, _ = read_checkpoint(path, model_only=True)
    assert (
        loaded["model"]["w"].tobytes() == model["w"].tobytes() and loaded["model"]["b"].tolist() == [1.0] * 10
    )
    assert sum(read) < 20_000  # the state and the model's 4 KB, not the optimizer's 5 MB
    with pytest.raises(
        CorruptCheckpointError, match=r"data.bin array 'optimizer.momentum' fails its checksum"
    ):
        read_checkpoint(path)


def test_a_save_writes_one_data_file_and_syncs_in_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    events: list[str] = []
    real_fsync, real_rename, real_replace = os.fsync, os.rename, os.replace

    def fsync(fd: int) -> None:
        events.append(
            "fsync " + os.path.basename(os.readlink(f"/proc/self/fd/{fd}")).split(".epochal-tmp-")[0]
        )
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", lambda a, b: (events.append("rename"), real_rename(a, b))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append("replace"), real_replace(a, b))[1])
    (tmp_path / "c").mkdir()
    path = save(tmp_path / "c", {"model": {"w": np.zeros(100)}})
    # the files and the temporary directory are fsynced together (concurrently: their order is
    # not fixed), all before the rename that publishes them
    assert sorted(events[:3]) == ["fsync ckpt-e0000-i000001", "fsync data.bin", "fsync manifest.json"]
    assert events[3:] == [
        "rename",
        "replace",  # latest: a link holding the name, durable with the directory sync below
        "fsync c",
    ]
    assert sorted(p.name for p in path.iterdir()) == ["data.bin", "manifest.json"]
    assert os.readlink(tmp_path / "c" / "latest") == path.name


def test_the_commit_record_is_the_manifest_last_key_and_any_change_is_caught(tmp_path: Path) -> None:
    path = save(tmp_path, {"w": np.zeros(3)})
    data = (path / "manifest.json").read_bytes()
    assert json.loads(data)["commit"] and data.endswith(b'"\n}\n')
    assert "commit" not in storage.read_manifest(path)
    for flipped in (
        data.replace(b'"version": 4', b'"version": 3'),
        data.replace(b'"sequence": 1', b'"sequence": 9'),
    ):
        (path / "manifest.json").write_bytes(flipped)
        with pytest.raises(CorruptCheckpointError, match=r"manifest\.json fails its checksum"):
            storage.read_manifest(path)
    unsealed = json.dumps({k: v for k, v in json.loads(data).items() if k != "commit"}).encode()
    (path / "manifest.json").write_bytes(unsealed)
    with pytest.raises(CorruptCheckpointError, match="no commit record"):
        storage.read_manifest(path)


def test_index_entries_sharing_a_record_are_refused_before_anything_is_allocated(tmp_path: Path) -> None:
    """A re-signed index pointing many arrays at one big record would allocate its size many
    times: records may not overlap, so what a read allocates is bounded by the file."""
    path = save(tmp_path, {"model": {"a": np.zeros(100_000), "b": np.ones(100_000)}})
    state = storage.read_state_document(path)
    first = state["arrays"][0]
    state["arrays"] = [dict(first), {**first, "path": ["model", "b"]}]
    storage.replace_state(path, state)
    with pytest.raises(CorruptCheckpointError, match=r"array 'model.b' overlaps the array before it"):
        read_checkpoint(path)


def test_no_fsync_thread_outlives_a_save_into_a_fork(tmp_path: Path) -> None:
    """A forked child (a DataLoader worker) gets no idle fsync threads, and the parent saves
    again after the fork (Python 3.12+ warns about forking a process with threads)."""

    def fsync_threads() -> list[str]:
        return [t.name for t in threading.enumerate() if t.name.startswith("epochal-fsync")]

    save(tmp_path, {"w": np.zeros(10)}, "ckpt-e0000-i000001")
    assert fsync_threads()  # the save's fsyncs ran on the pool
    pid = os.fork()
    if pid == 0:  # the child: report whether any fsync thread exists here, then leave at once
        os._exit(0 if not fsync_threads() else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert fsync_threads() == []  # shut down in the parent before the fork
    path = save(tmp_path, {"w": np.ones(10)}, "ckpt-e0001-i000002")
    assert read_checkpoint(path)[0]["w"].tolist() == [1.0] * 10


def test_a_failed_fsync_of_one_file_is_one_clear_error_and_the_earlier_checkpoint_is_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The files are fsynced concurrently: one that fails (EIO on data.bin) fails the save after
    every other fsync ended, names the checkpoint, leaves no temporary directory, and keeps the
    earlier checkpoint and ``latest``."""
    earlier = save(tmp_path, {"w": np.zeros(10)}, "ckpt-e0000-i000001")
    real_fsync = os.fsync
    ended: list[str] = []

    def fsync(fd: int) -> None:
        name = os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))
        if name == "data.bin":
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        real_fsync(fd)
        ended.append(name.split(".epochal-tmp-")[0])

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(
        CheckpointWriteError, match=r"cannot write checkpoint .*ckpt-e0001-i000002.*Input/output error"
    ):
        write_checkpoint(tmp_path, "ckpt-e0001-i000002", flatten({"w": np.ones(10)}), {"sequence": 2})
    assert sorted(ended) == ["ckpt-e0001-i000002", "manifest.json"]  # the others ran to their end
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-e0000-i000001", "latest"]
    assert read_pointer(tmp_path) == earlier.name
    assert read_checkpoint(earlier)[0]["w"].tolist() == [0.0] * 10


def test_a_save_when_no_thread_pool_takes_work_fsyncs_in_the_calling_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At interpreter exit a thread pool refuses work: the fsyncs then run in the saving thread."""
    from concurrent.futures import ThreadPoolExecutor

    refusing = ThreadPoolExecutor(max_workers=1)
    refusing.shutdown()
    monkeypatch.setattr(storage, "_sync_pool", refusing)
    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(threading.current_thread().name)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    path = save(tmp_path, {"w": np.ones(10)})
    assert read_checkpoint(path)[0]["w"].tolist() == [1.0] * 10
    assert synced and set(synced) == {threading.current_thread().name}
