"""Damaged checkpoints through the command line (issue 31): what each reader falls back to.

Each test trains the synthetic numpy model for two epochs with ``python -m epochal run`` (a
checkpoint per epoch: ``ckpt-e0001-i000016`` and ``ckpt-e0002-i000032``), damages the
checkpoint directory as a crash or a disk would, and runs the CLI again in a subprocess.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from epochal_checkpoint import list_checkpoints, load_latest, read_checkpoint
from epochal_checkpoint.testing import TORTURE_CONFIG

from epochal.testing import epochal_command

pytestmark = pytest.mark.slow

OLDER, NEWEST = "ckpt-e0001-i000016", "ckpt-e0002-i000032"


@pytest.fixture
def trained(tmp_path: Path) -> Path:
    """A project directory after a two-epoch run: ``run.toml`` and ``run/version_0/checkpoints``."""
    (tmp_path / "run.toml").write_text(TORTURE_CONFIG.format(size=1000, every=0, async_save="false"))
    done = epochal_command("run", "run.toml", "--set", "loop.max_epochs=2", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert [info.name for info in list_checkpoints(tmp_path / "run" / "version_0" / "checkpoints")[0]] == [
        OLDER,
        NEWEST,
    ]
    return tmp_path


def one_error_line(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 1, result.stderr
    return errors[0]


def test_a_damaged_npy_header_falls_back_to_the_previous_checkpoint(trained: Path) -> None:
    """numpy's header parser raised tokenize.TokenError on an unbalanced bracket: --resume,
    --resume auto, export and load stopped with a traceback although the previous checkpoint is
    intact."""
    directory = trained / "run" / "version_0" / "checkpoints"
    data = bytearray((directory / NEWEST / "data.bin").read_bytes())
    data[data.index(b"}")] = ord(" ")  # the closing brace of the first array's header
    (directory / NEWEST / "data.bin").write_bytes(data)
    older_model = read_checkpoint(directory / OLDER)[0]["model"]

    exported = epochal_command("export", "run/version_0/checkpoints", "-o", "w.safetensors", cwd=trained)
    assert exported.returncode == 0, exported.stderr
    assert f"{NEWEST}': data.bin array 'model.p0' has a bad .npy header" in exported.stderr
    assert f"checkpoint {directory.relative_to(trained) / OLDER}" in exported.stdout
    from safetensors.numpy import load_file

    assert np.array_equal(load_file(trained / "w.safetensors")["p0"], older_model["p0"])
    error = one_error_line(epochal_command("export", f"run/version_0/checkpoints/{NEWEST}", cwd=trained))
    assert f"{NEWEST}': data.bin array 'model.p0' has a bad .npy header: not a dict literal" in error

    other = trained / "other.toml"  # the load plugin, from another run's directory
    other.write_text((trained / "run.toml").read_text().replace('run_dir = "run"', 'run_dir = "other"'))
    loaded = epochal_command(
        "run", "other.toml", "--plugins", "load,checkpoint",
        "--set", "plugins.load.path=run/version_0/checkpoints", "--set", "loop.max_epochs=3", cwd=trained,
    )  # fmt: skip
    assert loaded.returncode == 0, loaded.stderr
    assert "Traceback" not in loaded.stderr and "bad .npy header" in loaded.stderr
    assert f"resumed from checkpoint {directory.relative_to(trained) / OLDER}" in loaded.stderr

    pristine = trained / "damaged-copy"
    shutil.copytree(directory, pristine, symlinks=True)
    for resume in (["--resume"], ["--resume", "auto"]):
        shutil.rmtree(directory)
        shutil.copytree(pristine, directory, symlinks=True)
        resumed = epochal_command("run", "run.toml", *resume, "--set", "loop.max_epochs=3", cwd=trained)
        assert resumed.returncode == 0, resumed.stderr
        assert "Traceback" not in resumed.stderr
        assert "bad .npy header" in resumed.stderr and "trying the previous checkpoint" in resumed.stderr
        assert f"resumed from checkpoint {directory.relative_to(trained) / OLDER}" in resumed.stderr
    state, info = load_latest(directory)
    assert info.name == "ckpt-e0003-i000048" and state["iteration"] == 48
    assert (directory / NEWEST).is_dir()  # the damaged one is kept, never pruned


def test_resume_auto_refuses_when_every_checkpoint_is_damaged(trained: Path) -> None:
    """It started a fresh run (exit 0) when every manifest was damaged; now it refuses as
    --resume does, and starts fresh only where no checkpoint directory exists at all."""
    directory = trained / "run" / "version_0" / "checkpoints"
    for name in (OLDER, NEWEST):
        manifest = directory / name / "manifest.json"
        manifest.write_bytes(manifest.read_bytes().replace(b'"epoch": ', b'"epoch":  ', 1))
    for resume in (["--resume", "auto"], ["--resume"]):
        error = one_error_line(
            epochal_command("run", "run.toml", *resume, "--set", "loop.max_epochs=3", cwd=trained)
        )
        if resume[-1] == "auto":
            assert "(--resume auto starts a fresh run only where no checkpoint exists" in error
        assert f"cannot resume: no complete checkpoint in '{directory.relative_to(trained)}'" in error
        assert f"ignored: {OLDER} (" in error and f"{NEWEST} (" in error
        assert "manifest.json fails its checksum" in error
    assert sorted(p.name for p in directory.iterdir() if p.name.startswith("ckpt")) == [OLDER, NEWEST]
    fresh = trained / "fresh.toml"
    fresh.write_text((trained / "run.toml").read_text().replace('run_dir = "run"', 'run_dir = "fresh"'))
    started = epochal_command(
        "run", "fresh.toml", "--resume", "auto", "--set", "loop.max_epochs=1", cwd=trained
    )
    assert started.returncode == 0, started.stderr
    assert (
        "epochal: --resume auto: no complete checkpoint in 'fresh/version_0/checkpoints' yet; "
        "starting a fresh run" in started.stderr  # prefixed as every other line (issue 47)
    )


def test_a_log_segment_missing_from_the_newest_is_taken_from_its_hard_link(tmp_path: Path) -> None:
    """Its rows were dropped; the older checkpoint holds the same file (same name and CRC-32).

    Ninety epochs: a short run's log rows stay in the state (few: see the checkpoint page); by
    then they have gone into a segment that the last two checkpoints both hold."""
    (tmp_path / "run.toml").write_text(TORTURE_CONFIG.format(size=1000, every=0, async_save="false"))
    done = epochal_command("run", "run.toml", "--set", "loop.max_epochs=90", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    directory = tmp_path / "run" / "version_0" / "checkpoints"
    older, newest = list_checkpoints(directory)[0]
    assert (older.name, newest.name) == ("ckpt-e0089-i001424", "ckpt-e0090-i001440")
    segment = older.manifest["log_segments"][0]
    assert segment in newest.manifest["log_segments"]
    rows = read_checkpoint(newest.path)[0]["log"]["rows"]
    assert "16" in rows and "32" in rows
    (newest.path / segment).unlink()
    resumed = epochal_command("run", "run.toml", "--resume", "--set", "loop.max_epochs=91", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert f"log segment {segment} is missing or damaged; its intact copy in {older.name}" in resumed.stderr
    assert "are lost" not in resumed.stderr
    state, info = load_latest(directory)
    assert info.name == "ckpt-e0091-i001456"
    assert {key: state["log"]["rows"][key] for key in rows} == rows  # rows 16 and 32 kept
    assert (directory / info.name / segment).is_file()  # linked into the new checkpoint
