"""storage.layout: names never overwritten, the latest pointer, leftovers of interrupted writes."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
from epochal_checkpoint import load_latest, read_checkpoint
from epochal_checkpoint.storage.codec import flatten
from epochal_checkpoint.storage.layout import (
    clean_temporaries,
    delete_checkpoint,
    finish_deletions,
    list_checkpoints,
    read_pointer,
)
from epochal_checkpoint.storage.write import write_checkpoint


def save(directory: Path, state: dict[str, Any], name: str = "ckpt-e0000-i000001", sequence: int = 1) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    return write_checkpoint(directory, name, flatten(state), {"sequence": sequence, "run_id": "r"}).path


def test_names_are_never_overwritten_and_pointer_names_the_newest(tmp_path: Path) -> None:
    first = save(tmp_path, {"w": 1}, "ckpt-e0001-i000010")
    second = save(tmp_path, {"w": 2}, "ckpt-e0001-i000010", sequence=2)
    assert (first.name, second.name) == ("ckpt-e0001-i000010", "ckpt-e0001-i000010-v2")
    assert read_pointer(tmp_path) == "ckpt-e0001-i000010-v2"
    assert read_checkpoint(first)[0]["w"] == 1 and load_latest(tmp_path)[0]["w"] == 2


def test_cleanup_removes_only_our_temporary_names(tmp_path: Path) -> None:
    ours = tmp_path / ("ckpt-e0000-i000001.epochal-tmp-" + "a" * 32)
    ours.mkdir()
    (ours / "arrays.npy").write_bytes(b"partial")
    (tmp_path / ("latest.epochal-tmp-" + "b" * 32)).write_text("x")
    keep = [
        tmp_path / "ckpt-e0000-i000001.tmp-123",
        tmp_path / "my-notes.tmp",
        tmp_path / "ckpt-moved-by-user",
    ]
    for path in keep:
        path.mkdir()
    removed = clean_temporaries(tmp_path)
    assert len(removed) == 2 and not ours.exists()
    assert all(path.exists() for path in keep)


def test_latest_is_read_only_as_a_link_holding_a_checkpoint_name(tmp_path: Path) -> None:
    first = save(tmp_path, {"w": 1}, "ckpt-e0001-i000010")
    assert read_pointer(tmp_path) == first.name and (tmp_path / "latest").is_symlink()
    (tmp_path / "latest").unlink()
    (tmp_path / "latest").write_text(first.name)  # a pointer file (formats 1-3): not read
    assert read_pointer(tmp_path) is None
    (tmp_path / "latest").unlink()
    (tmp_path / "latest").symlink_to(tmp_path / first.name)  # a path, not a bare name
    assert read_pointer(tmp_path) is None
    (tmp_path / "latest").unlink()
    assert read_pointer(tmp_path) is None


def test_listing_orders_by_save_sequence_and_names_what_it_ignores(tmp_path: Path) -> None:
    newer = save(tmp_path, {"w": 2}, "ckpt-e0000-i000001", sequence=2)
    older = save(tmp_path, {"w": 1}, "ckpt-e0009-i000009", sequence=1)
    damaged = save(tmp_path, {"w": 3}, "ckpt-e0010-i000010", sequence=3)
    (damaged / "manifest.json").write_bytes((damaged / "manifest.json").read_bytes().replace(b"3", b"4", 1))
    (tmp_path / "ckpt-e0011-i000011").symlink_to(older)
    (tmp_path / "ckpt-e0012-i000012").write_text("a file with a checkpoint's name")
    (tmp_path / "notes").mkdir()
    infos, ignored = list_checkpoints(tmp_path)
    assert [info.name for info in infos] == [older.name, newer.name]
    assert [name for name, _ in ignored] == [damaged.name, "ckpt-e0011-i000011"]
    assert "manifest.json fails its checksum" in ignored[0][1] and "symbolic link" in ignored[1][1]
    assert list_checkpoints(tmp_path / "missing") == ([], [])


def test_list_checkpoints_is_public_where_it_always_was() -> None:
    import epochal_checkpoint
    from epochal_checkpoint import storage
    from epochal_checkpoint.storage import layout

    assert epochal_checkpoint.list_checkpoints is storage.list_checkpoints is layout.list_checkpoints
    assert "list_checkpoints" in epochal_checkpoint.__all__ and "list_checkpoints" in storage.__all__


def test_one_listing_removes_the_leftovers_and_finds_the_checkpoints(tmp_path: Path) -> None:
    """``list_checkpoints(clean=True)`` (a run's start) deletes our temporary names, a tagged
    one too (its name would otherwise read as a tag), and lists only what is left."""
    kept = save(tmp_path, {"w": 1}, "ckpt-e0001-i000010")
    leftovers = [
        tmp_path / ("ckpt-e0002-i000020.epochal-tmp-" + "a" * 32),
        tmp_path / ("ckpt-e0003-i000030_loss=0.5.epochal-tmp-" + "b" * 32),
    ]
    for leftover in leftovers:
        leftover.mkdir()
        (leftover / "data.bin").write_bytes(b"partial")
    (tmp_path / ("latest.epochal-tmp-" + "c" * 32)).write_text("x")
    (tmp_path / "ckpt-moved-by-user").mkdir()
    found, ignored = list_checkpoints(tmp_path, clean=True)
    assert [info.name for info in found] == [kept.name] and ignored == []
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "ckpt-e0001-i000010",
        "ckpt-moved-by-user",
        "latest",
    ]


def test_deletions_in_the_background_start_no_thread_of_their_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Old checkpoints are deleted on the fsync threads: gone from their names at once, their
    files gone once ``finish_deletions`` returns, and no thread started for a deletion."""
    paths = [save(tmp_path, {"w": k}, f"ckpt-e000{k}-i00000{k}", sequence=k) for k in (1, 2, 3)]
    started: list[str] = []
    start = threading.Thread.start

    def recording_start(thread: threading.Thread) -> None:
        started.append(thread.name)
        start(thread)

    monkeypatch.setattr(threading.Thread, "start", recording_start)
    for path in paths[:2]:
        delete_checkpoint(path, wait=False)
        assert not path.exists()
    finish_deletions()
    assert sorted(p.name for p in tmp_path.iterdir()) == [paths[2].name, "latest"]
    assert all(name.startswith("epochal-fsync") for name in started), started  # the pool's, if any
