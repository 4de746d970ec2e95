"""storage.segments: log segments written, linked, merged on disk and read back."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from epochal_checkpoint import read_checkpoint
from epochal_checkpoint.storage.codec import flatten
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
