"""storage.segments: log segments written, linked, merged on disk and read back."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from epochal_checkpoint import read_checkpoint
from epochal_checkpoint.storage.codec import flatten
from epochal_checkpoint.storage.load import find_latest
from epochal_checkpoint.storage.segments import SEGMENT_HEAD, LinkedSegment, MergedSegment, NewSegment
from epochal_checkpoint.storage.write import write_checkpoint


def test_segments_beside_a_large_state(tmp_path: Path) -> None:
    weights = np.arange((1 << 22) // 8 + 1, dtype=np.float64)
    state = {"w": weights, "log": {"rows": {}, "status": {}}}
    first = write_checkpoint(
        tmp_path, "ckpt-e0000-i000001", flatten(state), {"sequence": 1},
        segments=[NewSegment("log-000001-i000001-000002.json", {"1": {"a": 1.0}, "2": {"a": 2.0}})],
    )  # fmt: skip
    assert first.segments is not None
    second = write_checkpoint(
        tmp_path, "ckpt-e0000-i000003", flatten(state), {"sequence": 2},
        segments=[LinkedSegment(first.path, first.segments[0]),
                  NewSegment("log-000002-i000002-000003.json", {"2": {}, "3": {"a": 3.0}})],
    )  # fmt: skip
    loaded, _ = read_checkpoint(second.path)
    assert loaded["log"]["rows"] == {"1": {"a": 1.0}, "3": {"a": 3.0}}  # row 2 emptied by the later segment
    assert loaded["w"].tobytes() == weights.tobytes()
    twice = [LinkedSegment(first.path, first.segments[0])] * 2
    with pytest.raises(ValueError, match="unique"):
        write_checkpoint(tmp_path, "ckpt-e0000-i000004", flatten(state), {"sequence": 3}, segments=twice)
    assert sorted(p.name for p in tmp_path.iterdir()) == [first.name, second.name, "latest"]


def test_a_merge_copies_segment_bytes_and_reloads_a_damaged_one(tmp_path: Path) -> None:

    state = {"w": np.zeros(2), "log": {"rows": {}, "status": {}}}
    parts = [
        NewSegment("log-000001-i000001-000002.json", {"1": {"a": 1.0}, "2": {"a": 2.0}}),
        NewSegment("log-000002-i000003-000004.json", {"3": {"a": 3.0}, "4": {"a": 4.0}}),
    ]
    first = write_checkpoint(tmp_path, "ckpt-e0000-i000004", flatten(state), {"sequence": 1}, segments=parts)
    assert first.segments is not None
    with open(first.path / parts[1].name, "r+b") as file:  # bit rot in the second segment
        file.seek(60)
        file.write(b"X")
    reloaded: list[str] = []

    def reload(segment: Any) -> dict[str, Any]:
        reloaded.append(segment.name)
        return {"3": {"a": 3.5}, "4": {}}  # the log's rows now: 3 changed, 4 emptied

    merged = MergedSegment(
        "log-000003-i000001-000005.json",
        [LinkedSegment(first.path, s) for s in first.segments],
        {"2": {}, "5": {"a": 5.0}},
        reload,
    )
    second = write_checkpoint(
        tmp_path, "ckpt-e0000-i000005", flatten(state), {"sequence": 2}, segments=[merged]
    )
    assert reloaded == [parts[1].name]  # only the damaged part came from the log
    data = (second.path / merged.name).read_bytes()
    assert (first.path / parts[0].name).read_bytes()[len(SEGMENT_HEAD) : -2] in data  # copied
    assert second.segments is not None and list(second.segments[0].rows) == [1, 2, 3, 4, 5]
    loaded, _ = read_checkpoint(second.path)
    assert loaded["log"]["rows"] == {"1": {"a": 1.0}, "3": {"a": 3.5}, "5": {"a": 5.0}}


def two_checkpoints(directory: Path) -> tuple[Any, Any]:
    """Two checkpoints: the second links the first's segment (rows 1-2) and adds rows 3-4."""
    state = {"w": np.arange(4.0), "log": {"rows": {}, "status": {}}}
    first = write_checkpoint(
        directory, "ckpt-e0000-i000002", flatten(state), {"sequence": 1},
        segments=[NewSegment("log-000001-i000001-000002.json", {"1": {"a": 1.0}, "2": {"a": 2.0}})],
    )  # fmt: skip
    assert first.segments is not None
    second = write_checkpoint(
        directory, "ckpt-e0000-i000004", flatten(state), {"sequence": 2},
        segments=[LinkedSegment(first.path, first.segments[0]),
                  NewSegment("log-000002-i000003-000004.json", {"3": {"a": 3.0}, "4": {"a": 4.0}})],
    )  # fmt: skip
    return first, second


ALL_ROWS = {"1": {"a": 1.0}, "2": {"a": 2.0}, "3": {"a": 3.0}, "4": {"a": 4.0}}


@pytest.mark.parametrize("damage", ["deleted", "replaced by other bytes"])
def test_a_segment_lost_from_the_newest_is_read_from_its_hard_link_in_an_older_one(
    tmp_path: Path, damage: str
) -> None:
    """Issue 31: its rows were dropped although an older checkpoint holds the same file."""
    first, second = two_checkpoints(tmp_path)
    name = "log-000001-i000001-000002.json"
    (second.path / name).unlink()
    if damage != "deleted":  # a new file (not the shared inode): the older link is intact
        (second.path / name).write_bytes((first.path / name).read_bytes().replace(b"2.0", b"9.0"))
    with pytest.warns(RuntimeWarning) as warned:
        read, failures = find_latest(tmp_path)
    assert read.name == second.name and failures == [] and read.damaged == []
    assert read.state["log"]["rows"] == ALL_ROWS
    assert read.segments is not None and [s.origin for s in read.segments] == [first.path, None]
    assert [str(w.message) for w in warned] == [
        f"checkpoint {str(second.path)!r}: log segment {name} is missing or damaged; its intact copy "
        f"in {first.name} (same size and CRC-32) is used"
    ]
    # the next save links the segment from where its bytes are; once the older checkpoints are
    # gone the new one still holds every row
    third = write_checkpoint(
        tmp_path, "ckpt-e0000-i000005", flatten(read.state), {"sequence": 3},
        segments=[LinkedSegment(read.path, segment) for segment in read.segments],
    )  # fmt: skip
    assert third.segments is not None and [s.origin for s in third.segments] == [None, None]
    shutil.rmtree(first.path)
    shutil.rmtree(second.path)
    assert read_checkpoint(third.path)[0]["log"]["rows"] == ALL_ROWS


def test_a_copy_of_another_size_or_crc_is_not_taken_and_the_rows_are_lost(tmp_path: Path) -> None:
    first, second = two_checkpoints(tmp_path)
    name = "log-000001-i000001-000002.json"
    (second.path / name).unlink()
    other = (first.path / name).read_bytes().replace(b"2.0", b"9.0")  # same size, another CRC-32
    (first.path / name).unlink()  # the older file replaced (a new inode), not the newest's
    (first.path / name).write_bytes(other)
    with pytest.warns(RuntimeWarning, match=rf"{name} is missing.*rows 1\.\.2 held by it are lost"):
        read, _ = find_latest(tmp_path)
    assert read.name == second.name and read.state["log"]["rows"] == {"3": {"a": 3.0}, "4": {"a": 4.0}}
    assert [segment for segment, _ in read.damaged] == [name]
