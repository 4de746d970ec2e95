"""storage.load: a checkpoint's state read back (all or the model only), the newest that verifies."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from epochal_checkpoint import CorruptCheckpointError, list_checkpoints, load_latest, read_checkpoint
from epochal_checkpoint.storage.codec import flatten
from epochal_checkpoint.storage.load import find_latest, read_state_document
from epochal_checkpoint.storage.write import write_checkpoint
from epochal_checkpoint.testing import replace_state


def save(directory: Path, state: dict[str, Any], name: str = "ckpt-e0000-i000001", sequence: int = 1) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    return write_checkpoint(directory, name, flatten(state), {"sequence": sequence, "run_id": "r"}).path


@pytest.mark.parametrize("damage", ["flip a byte", "truncate", "delete data.bin", "garble manifest"])
def test_a_corrupt_latest_falls_back_to_the_previous_one_with_a_warning(tmp_path: Path, damage: str) -> None:
    save(tmp_path, {"w": np.full(1000, 1.0)}, "ckpt-e0000-i000001", 1)
    newest = save(tmp_path, {"w": np.full(1000, 2.0)}, "ckpt-e0000-i000002", 2)
    if damage == "flip a byte":
        data = bytearray((newest / "data.bin").read_bytes())
        data[500] ^= 0xFF
        (newest / "data.bin").write_bytes(data)
    elif damage == "truncate":
        with open(newest / "data.bin", "r+b") as file:
            file.truncate(100)
    elif damage == "delete data.bin":
        (newest / "data.bin").unlink()
    else:
        (newest / "manifest.json").write_text("{not json")
    with pytest.raises(CorruptCheckpointError, match="ckpt-e0000-i000002"):
        read_checkpoint(newest)
    if damage == "garble manifest":  # not even listed as a checkpoint, but reported
        assert [name for name, _ in list_checkpoints(tmp_path)[1]] == ["ckpt-e0000-i000002"]
    with pytest.warns(RuntimeWarning) as warned:
        state, info = load_latest(tmp_path)
    assert "ckpt-e0000-i000002" in str(warned[0].message)
    assert info.name == "ckpt-e0000-i000001" and state["w"][0] == 1.0


def test_every_checkpoint_corrupt_is_one_error_listing_them(tmp_path: Path) -> None:
    for i in (1, 2):
        path = save(tmp_path, {"w": np.zeros(10)}, f"ckpt-e0000-i00000{i}", i)
        (path / "data.bin").write_bytes(b"\x93NUMPY garbage")
    with (
        pytest.warns(RuntimeWarning),
        pytest.raises(CorruptCheckpointError, match=r"every checkpoint.*i000001"),
    ):
        load_latest(tmp_path)


def test_model_only_reads_and_checks_only_the_model_arrays(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = {"w": np.arange(1000, dtype=np.float32), "b": np.ones(10)}
    other = {"momentum": np.full(500_000, 3.0), "big": np.zeros(300_000, np.int32)}
    path = save(tmp_path, {"model": model, "optimizer": other, "epoch": 2})
    state = read_state_document(path)
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


def test_index_entries_sharing_a_record_are_refused_before_anything_is_allocated(tmp_path: Path) -> None:
    """A re-signed index pointing many arrays at one big record would allocate its size many
    times: records may not overlap, so what a read allocates is bounded by the file."""
    path = save(tmp_path, {"model": {"a": np.zeros(100_000), "b": np.ones(100_000)}})
    state = read_state_document(path)
    first = state["arrays"][0]
    state["arrays"] = [dict(first), {**first, "path": ["model", "b"]}]
    replace_state(path, state)
    with pytest.raises(CorruptCheckpointError, match=r"array 'model.b' overlaps the array before it"):
        read_checkpoint(path)


def _flip_in_array(checkpoint: Path, key: str) -> None:
    """Flip one byte inside array *key*'s bytes in ``data.bin`` (its header left intact)."""
    entry = next(e for e in read_state_document(checkpoint)["arrays"] if e["path"] == [key])
    data = bytearray((checkpoint / "data.bin").read_bytes())
    data[entry["offset"] + 200] ^= 0xFF  # past the .npy header (128 bytes)
    (checkpoint / "data.bin").write_bytes(data)


def test_arrays_are_read_into_their_destinations_only_when_dtype_and_shape_match(tmp_path: Path) -> None:
    saved = {
        "a": np.arange(1000, dtype=np.float32),
        "b": np.arange(12, dtype=np.int64).reshape(3, 4),
        "c": np.ones(10, np.float64),
        "d": np.arange(6, dtype=np.int16),
    }
    checkpoint = save(tmp_path, saved)
    into = {
        "a": np.zeros(1000, np.float32),
        "b": np.zeros((3, 4), np.int64),
        "c": np.zeros(10, np.float32),  # another dtype: not a destination
        "d": np.zeros(6, np.int16)[::-1].copy()[::-1],  # not C-contiguous: not a destination
    }
    frozen = np.zeros(1000, np.float32)
    frozen.flags.writeable = False
    state, _ = read_checkpoint(checkpoint, into=into)
    assert state["a"] is into["a"] and state["b"] is into["b"]
    assert np.array_equal(into["a"], saved["a"]) and np.array_equal(into["b"], saved["b"])
    assert state["c"] is not into["c"] and not into["c"].any()
    assert not np.shares_memory(state["d"], into["d"]) and not into["d"].any()
    for key in saved:
        assert np.array_equal(state[key], saved[key]), key
    state, _ = read_checkpoint(checkpoint, into={"a": frozen})  # read-only: not a destination
    assert not np.shares_memory(state["a"], frozen) and not frozen.any()


def test_a_damaged_checkpoint_leaves_the_destinations_untouched(tmp_path: Path) -> None:
    save(tmp_path, {"a": np.full(1000, 1.0), "z": np.full(1000, 1.0)}, "ckpt-e0000-i000001", 1)
    newest = save(tmp_path, {"a": np.full(1000, 2.0), "z": np.full(1000, 2.0)}, "ckpt-e0000-i000002", 2)
    _flip_in_array(newest, "z")  # the last array is damaged: "a", before it, verifies
    into = {"a": np.full(1000, -1.0), "z": np.full(1000, -1.0)}
    with pytest.raises(CorruptCheckpointError, match="array 'z' fails its checksum"):
        read_checkpoint(newest, into=into)
    assert (into["a"] == -1).all() and (into["z"] == -1).all()  # nothing written, not even "a"
    with pytest.warns(RuntimeWarning, match="ckpt-e0000-i000002"):
        read, failures = find_latest(tmp_path, into=into)
    assert [p.name for p, _ in failures] == ["ckpt-e0000-i000002"]
    assert read.state["a"] is into["a"] and (into["a"] == 1).all() and (into["z"] == 1).all()


def test_a_data_file_changed_after_it_verified_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from epochal_checkpoint.storage import load

    checkpoint = save(tmp_path, {"a": np.full(1000, 3.0)})
    run = load.Fills.run

    def damage_then_run(self: load.Fills) -> None:
        _flip_in_array(checkpoint, "a")  # a writer inside the committed checkpoint, mid-read
        run(self)

    monkeypatch.setattr(load.Fills, "run", damage_then_run)
    with pytest.raises(CorruptCheckpointError, match="changed while it was read, after it verified"):
        read_checkpoint(checkpoint, into={"a": np.zeros(1000)})
