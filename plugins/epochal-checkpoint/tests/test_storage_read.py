"""storage.read: bounded reads, the manifest's commit record and format version, foreign files."""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from epochal_checkpoint import (
    CorruptCheckpointError,
    ForeignCheckpointError,
    UnsafeCheckpointError,
    read_checkpoint,
)
from epochal_checkpoint.storage.codec import flatten
from epochal_checkpoint.storage.read import read_manifest
from epochal_checkpoint.storage.write import write_checkpoint
from epochal_checkpoint.testing import resign


def save(directory: Path, state: dict[str, Any], name: str = "ckpt-e0000-i000001", sequence: int = 1) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    return write_checkpoint(directory, name, flatten(state), {"sequence": sequence, "run_id": "r"}).path


def test_a_pickle_file_is_refused(tmp_path: Path) -> None:
    file = tmp_path / "model.pt"
    file.write_bytes(pickle.dumps({"w": [1, 2]}))
    with pytest.raises(UnsafeCheckpointError, match=r"model.pt.*pickle file"):
        read_checkpoint(file)


def test_foreign_directories_and_files_are_clear_errors(tmp_path: Path) -> None:
    (tmp_path / "plain").mkdir()
    with pytest.raises(ForeignCheckpointError, match=r"plain.*no manifest.json"):
        read_checkpoint(tmp_path / "plain")
    other = tmp_path / "other"
    other.mkdir()
    (other / "manifest.json").write_text('{"format": "orbax"}')
    with pytest.raises(ForeignCheckpointError, match="another format"):
        read_checkpoint(other)
    newer = save(tmp_path / "newer", {"w": 1})
    manifest = json.loads((newer / "manifest.json").read_text())
    resign(newer, {**manifest, "version": 99})
    with pytest.raises(ForeignCheckpointError, match="format version 99"):
        read_checkpoint(newer)
    np.savez(tmp_path / "weights.npz", w=np.zeros(2))
    with pytest.raises(ForeignCheckpointError, match="zip archive"):
        read_checkpoint(tmp_path / "weights.npz")


def test_the_commit_record_is_the_manifest_last_key_and_any_change_is_caught(tmp_path: Path) -> None:
    path = save(tmp_path, {"w": np.zeros(3)})
    data = (path / "manifest.json").read_bytes()
    assert json.loads(data)["commit"] and data.endswith(b'"\n}\n')
    assert "commit" not in read_manifest(path)
    for flipped in (
        data.replace(b'"version": 4', b'"version": 3'),
        data.replace(b'"sequence": 1', b'"sequence": 9'),
    ):
        (path / "manifest.json").write_bytes(flipped)
        with pytest.raises(CorruptCheckpointError, match=r"manifest\.json fails its checksum"):
            read_manifest(path)
    unsealed = json.dumps({k: v for k, v in json.loads(data).items() if k != "commit"}).encode()
    (path / "manifest.json").write_bytes(unsealed)
    with pytest.raises(CorruptCheckpointError, match="no commit record"):
        read_manifest(path)


@pytest.mark.parametrize("version", [1, 2, 3, 5])
def test_a_format_other_than_4_is_one_error_naming_the_version_found_and_expected(
    tmp_path: Path, version: int
) -> None:
    """Formats 1-3 (development versions before 0.1.0) are no longer read; nor is a newer one."""
    path = save(tmp_path, {"w": np.zeros(3)})
    manifest = json.loads((path / "manifest.json").read_text())
    resign(path, {**manifest, "version": version})
    hint = "never released; not read" if version < 4 else "upgrade epochal-checkpoint"
    for read in (read_manifest, read_checkpoint):
        with pytest.raises(ForeignCheckpointError) as error:
            read(path)
        assert str(error.value) == (
            f"checkpoint {str(path)!r} has format version {version}; this epochal-checkpoint reads "
            f"format version 4 (written by a development version before 0.1.0, {hint})"
            if version < 4
            else f"checkpoint {str(path)!r} has format version {version}; this epochal-checkpoint reads "
            f"format version 4 ({hint})"
        )
